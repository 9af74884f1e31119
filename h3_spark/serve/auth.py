"""Bearer-token authentication for the service: required whenever it listens beyond this machine.

The token comes from `--api-key-file FILE` (its first line) or `H3_API_KEY`; or several named keys come from
`--keys-file FILE` (one `NAME TOKEN [admin]` a line), each client seeing only its own jobs, an admin all of them.
Every route asks for `Authorization: Bearer <token>`; a missing or wrong one gets 401 with no detail. The
comparison takes the same time whatever the token's prefix (hmac.compare_digest, against every key), and a token
is never logged or reported: records and logs carry the key's name.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import stat
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Client:
    """Whose request it is: the key's name, and whether that key sees every client's jobs."""

    name: str
    admin: bool = False


NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_KEYS = 1000


def read_keys_file(file: Path) -> dict[str, Client]:
    """token -> Client from a keys file: one `NAME TOKEN [admin]` a line, `#` starts a comment. Refused at start:
    a file others may read or write, a line that is not that, a short token, a name or token given twice."""
    path = Path(file)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"--keys-file {file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--keys-file {file}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InputError(f"--keys-file {file} is open to other users (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    keys: dict[str, Client] = {}
    names: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--keys-file {file}, line {number}"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "admin") or not NAME.fullmatch(words[0]):
            raise InputError(f"{where}: expected `NAME TOKEN [admin]` (NAME of letters, digits, _ . -)")
        name, token = words[0], words[1]
        if len(token) < MIN_LENGTH:
            raise InputError(f"{where}: the token of {name} is {len(token)} characters; use at least {MIN_LENGTH}")
        if name in names or token in keys:
            raise InputError(f"{where}: {'the name ' + name if name in names else 'a token'} is given twice")
        names.add(name)
        keys[token] = Client(name, admin=len(words) == 3)
    if not keys:
        raise InputError(f"--keys-file {file} holds no key")
    if len(keys) > MAX_KEYS:
        raise InputError(f"--keys-file {file} holds {len(keys)} keys; at most {MAX_KEYS}")
    return keys


def key_ring(api_key: "str | dict[str, Client] | None") -> dict[str, Client] | None:
    """The keys the service checks: a single token is one admin client, "default"."""
    if api_key is None or isinstance(api_key, dict):
        return api_key
    return {api_key: Client("default", admin=True)}


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


def client_of(request) -> Client | None:
    """The key a request came with (what BearerAuth put in its scope), None when the service has no keys."""
    return request.scope.get("state", {}).get("client")


def sees(client: Client | None, record: dict) -> bool:
    """Whether `client` may see a job of this record: its own, every job for an admin key or without keys."""
    return client is None or client.admin or record.get("client") == client.name


class BearerAuth:
    """ASGI middleware: HTTP requests without a right bearer token end here with 401; the others carry their
    `Client` in `scope["state"]["client"]`."""

    def __init__(self, app, key: "str | dict[str, Client]"):
        self.app = app
        self.expected = [(f"Bearer {token}".encode(), client) for token, client in key_ring(key).items()]

    async def __call__(self, scope, receive, send):
        client = self._client(scope) if scope["type"] == "http" else None
        if scope["type"] != "http" or client is not None:
            if client is not None:
                scope.setdefault("state", {})["client"] = client
            return await self.app(scope, receive, send)
        from .api_errors import error_response

        # No detail on which part was wrong (missing, unknown, another scheme).
        response = error_response(scope["path"], 401, "unauthorized", {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _client(self, scope) -> Client | None:
        given = next((value for name, value in scope.get("headers", []) if name == b"authorization"), b"")
        found = None
        for expected, client in self.expected:  # every key compared: the time does not say which one matched
            if hmac.compare_digest(given, expected):
                found = client
        return found
