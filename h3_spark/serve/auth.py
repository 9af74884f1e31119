"""Bearer-token authentication for the service: required whenever it listens beyond this machine.

The token comes from `--api-key-file FILE` (its first line) or `H3_API_KEY`. Every route asks for
`Authorization: Bearer <token>`; a missing or wrong one gets 401 with no detail. The comparison takes the same
time whatever the token's prefix (hmac.compare_digest), and the token is never logged or reported.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from ..errors import InputError

ENV = "H3_API_KEY"
MIN_LENGTH = 16


def read_api_key(file: Path | None, environ=os.environ) -> str | None:
    """The token: the file's first line, else $H3_API_KEY, else None. A named file that is missing, unreadable,
    empty or too short is an error (a typo must not leave the service open)."""
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(f"--api-key-file {file}: no such file") from None
        except OSError as exc:
            raise InputError(f"--api-key-file {file}: cannot read it ({exc.strerror})") from None
        key, source = (text.splitlines() or [""])[0].strip(), f"--api-key-file {file}"
    elif environ.get(ENV, "").strip():
        key, source = environ[ENV].strip(), ENV
    else:
        return None
    if not key:
        raise InputError(f"{source} is empty: put the token on its first line")
    if len(key) < MIN_LENGTH:
        raise InputError(f"{source}: the token is {len(key)} characters; use at least {MIN_LENGTH} "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return key


# The Host headers a loopback service answers by default (serve --allowed-host): a page whose name an attacker's
# DNS points at 127.0.0.1 sends its own name, and is refused.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond this machine


def check_binding(host: str, key: str | None) -> str | None:
    """Refuse to listen beyond loopback without a token; returns a line for the log (never the token)."""
    if key is None and not is_loopback(host):
        raise InputError(f"--host {host} listens beyond this machine and the API has no token: give one with "
                         f"--api-key-file FILE (or {ENV}), or bind 127.0.0.1")
    if key is not None:
        where = "on loopback too" if is_loopback(host) else f"on {host}"
        return f"every request needs its bearer token ({where})"
    return None


class BearerAuth:
    """ASGI middleware: HTTP requests without the right bearer token end here with 401."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._allowed(scope):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b'{"error": "unauthorized"}'})

    def _allowed(self, scope) -> bool:
        given = next((value for name, value in scope.get("headers", []) if name == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)
