"""Ports for the services the tests start.

A port taken by binding to 0 comes from the kernel's ephemeral range, and it is free only until someone
else needs an ephemeral port: between picking it and the service binding it (after its models load), gloo's
TCP pairs and torchrun's own sockets open many. So: a free port below the ephemeral range, which the kernel
never hands out by itself.
"""

import random
import socket


def free_port() -> int:
    low = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, max(low + 1000, ephemeral_start))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {low} and {ephemeral_start}")
