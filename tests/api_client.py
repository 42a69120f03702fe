"""A plain HTTP client for the tests of the listener (the standard library's, so that
what is tested is the daemon's HTTP, not a client library's leniency), and API tokens
made on a daemon's database as `perfectschedctl token add` makes them."""

from __future__ import annotations

import http.client
import json
import ssl
import time
from dataclasses import dataclass
from email.message import Message
from typing import Any

from daemon_harness import Daemon

from perfectschedd.store.sql import Store


@dataclass
class Answer:
    status: int
    headers: Message
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> str:
        obj = self.json
        assert set(obj) == {"error"} and "\n" not in obj["error"], obj
        return str(obj["error"])


def call(port: int, method: str, path: str, token: str | None = None,
         body: Any = None, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
         tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> Answer:
    conn: http.client.HTTPConnection
    if tls is not None:
        conn = http.client.HTTPSConnection(host, port, timeout=30, context=tls)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=30)
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                        else None)
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return Answer(response.status, response.headers, response.read())
    finally:
        conn.close()


def make_token(d: Daemon, name: str, role: str, expires_in: float | None = None) -> str:
    """A token on `d`'s database; its secret."""
    store = Store(d.config["url"], d.config.get("table", "perfectsched"), 10)
    try:
        now = time.time()
        _, secret = store.add_token(name, role, "root", None if expires_in is None
                                    else now + expires_in, now)
        return secret
    finally:
        store.close()


def revoke_token(d: Daemon, name: str) -> None:
    store = Store(d.config["url"], d.config.get("table", "perfectsched"), 10)
    try:
        store.revoke_token(name, time.time())
    finally:
        store.close()
