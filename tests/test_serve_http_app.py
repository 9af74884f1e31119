"""The HTTP scaffolding the service and the fleet's router share (serve/http_app.py), on an app of its own: each
refusal's status and JSON text, the middleware's order, the body reading, /live and /metrics."""

import random
import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from h3_spark.serve.http_app import build_app, json_body, live, metrics_endpoint, png  # noqa: E402
from h3_spark.serve.http_limits import ClientGone, HttpLimits  # noqa: E402
from h3_spark.serve.validation import RequestError  # noqa: E402

TOKEN = "scaffold-token-0123456789abcdef"


class _Metrics:
    def render(self):
        return b"h3_spark_test 1\n", "text/plain; version=0.0.4"


def _app(lines: list[str], api_key=None, allowed_hosts=None, metrics=None, limits=HttpLimits()):
    async def echo(request):
        from starlette.responses import JSONResponse

        return JSONResponse({"got": await json_body(request, 256, limits.body_timeout_s)})

    async def refuse(request):
        raise RequestError(429, "the queue is full", {"Retry-After": "7"})

    async def hang_up(request):
        raise ClientGone()

    async def broken(request):
        raise KeyError("a secret detail")

    async def image(request):
        return png(b"\x89PNG-bytes")

    routes = [Route("/echo", echo, methods=["POST"]), Route("/refuse", refuse), Route("/gone", hang_up),
              Route("/broken", broken), Route("/image", image), Route("/live", live),
              Route("/metrics", metrics_endpoint(lambda: metrics, "serve", in_thread=True))]
    return build_app(routes, None, limits, allowed_hosts, api_key, lines.append)


def test_every_refusal_is_json_with_its_status():
    lines: list[str] = []
    with TestClient(_app(lines), raise_server_exceptions=False) as client:
        got = client.get("/refuse")
        assert (got.status_code, got.json(), got.headers["retry-after"]) == (429, {"error": "the queue is full"}, "7")
        got = client.get("/nowhere")
        assert (got.status_code, got.json()) == (404, {"error": "GET /nowhere: Not Found"})
        got = client.post("/refuse")
        assert (got.status_code, got.json()) == (405, {"error": "POST /refuse: Method Not Allowed"})
        got = client.get("/broken")
        assert (got.status_code, got.json()) == (500, {"error": "internal error: KeyError"})
        got = client.get("/gone")
        assert got.status_code == 400 and got.content == b""
    assert len(lines) == 1 and lines[0].endswith("disconnected before sending its body of GET /gone; nothing done")


def test_json_bodies_are_typed_bounded_and_strict():
    rng = random.Random(38)
    body = {"seed": rng.randrange(1 << 30), "prompt": "".join(rng.choice("abc ") for _ in range(20))}
    with TestClient(_app([])) as client:
        got = client.post("/echo", json=body)
        assert (got.status_code, got.json()) == (200, {"got": body})
        got = client.post("/echo", content=b"{}", headers={"content-type": "text/plain"})
        assert (got.status_code, got.json()) == (
            415, {"error": "POST /echo takes Content-Type: application/json, got 'text/plain'"})
        got = client.post("/echo", content=b'{"x": NaN}', headers={"content-type": "application/json"})
        assert (got.status_code, got.json()) == (400, {"error": "NaN is not valid JSON"})
        got = client.post("/echo", content=b"[" + b"1," * 200 + b"1]", headers={"content-type": "application/json"})
        assert (got.status_code, got.json()) == (413, {"error": "the request body is 403 bytes; the limit is 256"})


def test_middleware_counts_headers_first_then_the_host_then_the_token():
    app = _app([], api_key=TOKEN, allowed_hosts=("127.0.0.1",), limits=HttpLimits(max_headers=8))
    many = {f"x-h{i}": "1" for i in range(9)}
    with TestClient(app, base_url="http://127.0.0.1") as client:
        # Too many headers: 431 before the token is asked for.
        got = client.get("/live", headers=many)
        # (the test client adds its own few to the nine)
        assert got.status_code == 431 and re.fullmatch(r"the request has 1[0-9] headers; the limit is 8",
                                                       got.json()["error"])
        got = client.get("/live", headers={"host": "attacker.example"})
        assert got.status_code == 400 and got.json()["error"].startswith("Host 'attacker.example'")  # before the token
        assert client.get("/live", headers={"host": "127.0.0.1:8000",
                                            "Authorization": f"Bearer {TOKEN}"}).status_code == 200
        got = client.get("/live")
        assert (got.status_code, got.json(), got.headers["www-authenticate"]) == (
            401, {"error": "unauthorized"}, "Bearer")
        got = client.get("/live", headers={"Authorization": f"Bearer {TOKEN}"})
        assert (got.status_code, got.json()) == (200, {"alive": True})


def test_metrics_and_the_preview_png():
    with TestClient(_app([], metrics=_Metrics())) as client:
        got = client.get("/metrics")
        assert got.status_code == 200 and got.text == "h3_spark_test 1\n"
        got = client.get("/image")
        assert (got.content, got.headers["content-type"], got.headers["cache-control"]) == (
            b"\x89PNG-bytes", "image/png", "no-store")
    with TestClient(_app([])) as client:
        got = client.get("/metrics")
        assert (got.status_code, got.json()) == (
            501, {"error": "/metrics needs prometheus-client: pip install 'h3-spark[serve]'"})


def test_the_host_list_takes_ports_ipv6_and_sub_domains():
    from h3_spark.serve.http_app import host_name

    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:8000", "[::1]", "H3.Example", "h3.example:443")] == [
        "127.0.0.1", "[::1]", "[::1]", "h3.example", "h3.example"]
    app = _app([], allowed_hosts=("[::1]", "*.h3.example"))
    with TestClient(app, base_url="http://[::1]:8000") as client:
        for host, status in (("[::1]:8000", 200), ("api.h3.example", 200), ("a.b.h3.example:8000", 200),
                             ("h3.example", 400), ("evilh3.example", 400), ("", 400)):
            got = client.get("/live", headers={"host": host})
            assert got.status_code == status, host
            if status == 400:
                assert got.json() == {"error": f"Host {host!r} is not a name this server answers to "
                                               f"(--allowed-host)"}
