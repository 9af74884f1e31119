"""Keeps a local fleet's Ray Serve replicas on loopback.

Ray Serve (2.60) gives every deployment replica a gRPC server for calls between deployments and binds it to `[::]`,
every interface, with no setting to say otherwise and no authentication; the fleet does not use it (its calls go
through Ray's actor calls), yet it answers anyone who reaches the machine. On a local head (`h3-spark fleet`
without --address, cli/fleet.py) every worker process of the job runs `bind_serve_grpc_to_loopback` first (Ray's
`worker_process_setup_hook`), which makes that server listen on 127.0.0.1. tests/test_fleet.py lists the fleet's
listening sockets, so a Ray that moves this server elsewhere fails there, not silently.
"""

from __future__ import annotations

WILDCARDS = ("[::]", "0.0.0.0", "")
HOOK = "h3_spark.serve.fleet.loopback.bind_serve_grpc_to_loopback"


def bind_serve_grpc_to_loopback() -> None:
    from ...errors import H3Error

    try:
        from ray.serve._private import replica
    except ImportError as exc:
        raise H3Error(f"this Ray has no ray.serve._private.replica ({exc}); the fleet cannot keep Serve's "
                      f"replica gRPC server on loopback") from None
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        raise H3Error("this Ray's Serve replica no longer binds its gRPC server through add_port_to_grpc_server; the "
                      "fleet cannot keep it on loopback (update serve/fleet/loopback.py)")
    if getattr(original, "keeps_loopback", False):
        return

    def on_loopback(server, address: str):
        host, _, port = address.rpartition(":")
        return original(server, f"127.0.0.1:{port}" if host in WILDCARDS else address)

    on_loopback.keeps_loopback = True
    replica.add_port_to_grpc_server = on_loopback
