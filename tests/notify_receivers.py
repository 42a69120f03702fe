"""Real receivers of notifications for the tests (tests/notify/, tests/daemon/): a webhook
server on loopback that records what it is sent, and a sendmail stand-in script that
records its arguments and standard input."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class Receiver:
    """An HTTP server on 127.0.0.1: `mode` "ok" answers 204, "500" answers 500, "hang"
    never answers (until closed), "redirect" answers 307 to `location`; each answer
    after `delay` seconds (a slow receiver)."""

    def __init__(self, mode: str = "ok", location: str | None = None,
                 delay: float = 0.0) -> None:
        self.mode = mode
        self.delay = delay
        self.location = location
        self.docs: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.authorizations: list[str | None] = []  # each POST's Authorization header
        self.lock = threading.Lock()
        self.closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.requests.append(("POST", self.path))
                    outer.authorizations.append(self.headers.get("Authorization"))
                    if outer.mode != "redirect":
                        outer.docs.append(json.loads(body))
                if outer.mode == "hang":
                    outer.closing.wait(60)
                    return
                if outer.delay:
                    time.sleep(outer.delay)
                if outer.mode == "redirect":
                    self.send_response(307)
                    self.send_header("Location", outer.location or "/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(500 if outer.mode == "500" else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def keys(self) -> list[str]:
        with self.lock:
            return [d["key"] for d in self.docs]

    def events(self) -> list[tuple[str, str]]:
        with self.lock:
            return [(d["event"], d["outcome"]) for d in self.docs]

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def sendmail_stand_in(directory: Path) -> tuple[Path, Path]:
    """A script that, as sendmail, appends its arguments and each message it reads to a
    file: (the script, the file)."""
    out = directory / "mails"
    script = directory / "sendmail"
    script.write_text(f"#!/bin/sh\n{{ echo \"ARGS: $*\"; cat; echo '--END--'; }} >> {out}\n")
    script.chmod(0o755)
    return script, out


def mails(out: Path) -> list[str]:
    try:
        text = out.read_text()
    except FileNotFoundError:
        return []
    # Only whole messages: the last piece is one the stand-in is still writing (its
    # arguments come first, the message as sendmail reads it, then the end mark).
    return [m for m in text.split("--END--\n")[:-1] if m.strip()]


def wait_for(pred: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def executable_exists(path: str) -> bool:
    return os.access(path, os.X_OK)
