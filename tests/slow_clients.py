"""Slow and real clients on raw sockets, for the service's and the fleet front's slow-client tests."""

import socket
import time


def stalled(port: int, kind: str, path: str = "/echo") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    if kind == "head":
        s.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # never finished
    else:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
                  + b"Content-Length: 100\r\n\r\n{\"a\": ")  # 6 of 100 bytes
    return s


def closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `s` within `seconds`, and what it sent before."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True, got
            got += chunk
    except socket.timeout:
        return False, got
    except ConnectionResetError:
        return True, got


def raw_request(port: int, raw: bytes) -> tuple[int, dict, float]:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    head = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), {k.lower(): v for k, v in headers.items()}, time.perf_counter() - start


LIVE = b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
ECHO = (b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}")
