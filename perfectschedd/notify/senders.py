"""Sending one notification: a command (exec), a mail through sendmail -t (mail), or an
HTTP(S) POST of one JSON document (webhook).  Each call either returns (sent) or raises
SendError with one line saying why; retries and counting are dispatch.py's.

Everything here runs on the worker's notification thread, never on the lease pipeline's,
so a slow command or a receiver that hangs delays other notifications at most, each call
bounded by its timeout.

Commands (exec notifiers, sendmail) start from cron's environment of the user they run as
(runas.job_environment), never the daemon's, and never run as a uid that may start units:
under a root daemon as `notify_user` (config._notify_host), and not at all under a daemon
holding the polkit grant (`refused`).
"""

from __future__ import annotations

import email.message
import email.utils
import http.client
import json
import os
import signal
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from perfectschedd import __version__
from perfectschedd.executors import reaper
from perfectschedd.settings import runas
from perfectschedd.settings.notify_spec import Notifier, webhook_secrets

# Bounds: a notifier must not hold the notification thread for long.
EXEC_TIMEOUT = 30.0
MAIL_TIMEOUT = 30.0
WEBHOOK_TIMEOUT = 10.0
# Same-host 307/308 redirects followed (they keep the POST and its body).
REDIRECTS_MAX = 3
# Output sent along (stdin of exec, the mail's body, the webhook's "output"): its tail.
OUTPUT_TAIL = 8192
# What a failing notifier said, in our log line.
_ERROR_TAIL = 200


class SendError(Exception):
    """A notification was not delivered; the message is one line."""


@dataclass(frozen=True)
class Message:
    """One notification about one recorded run.  `event`: failure, recovery or output."""

    event: str
    host: str
    run: dict[str, Any] = field(hash=False)

    def document(self) -> dict[str, Any]:
        """The webhook's JSON (and the fields every kind tells)."""
        r = self.run
        return {
            "event": self.event, "key": r.get("key"), "type": r.get("type"),
            "scheduled_time": r.get("scheduled_time"), "attempt": r.get("attempt"),
            "outcome": r.get("outcome"), "exit_code": r.get("exit_code"),
            "signal": r.get("signal"), "duration": _duration(r),
            "started_at": r.get("started_at"), "finished_at": r.get("finished_at"),
            "error": r.get("error"), "output": self.output(), "host": self.host,
            "worker": r.get("worker"), "version": __version__,
            # Earlier runs of the key this one stands for, merged while it waited.
            "coalesced": int(r.get("coalesced") or 0),
        }

    def output(self) -> str:
        out = self.run.get("output") or ""
        if isinstance(out, bytes):
            out = out.decode("utf-8", "replace")
        return str(out)[-OUTPUT_TAIL:]

    def subject(self) -> str:
        r = self.run
        what = {"failure": "FAILED", "recovery": "recovered", "output": "output"}.get(
            self.event, self.event)
        code = f" (exit {r['exit_code']})" if r.get("exit_code") is not None else ""
        return f"[perfectsched] {r.get('key')} {what}: {r.get('outcome')}{code} on {self.host}"

    def environment(self) -> dict[str, str]:
        d = self.document()
        names = {"KEY": "key", "TYPE": "type", "SCHEDULED_TIME": "scheduled_time",
                 "ATTEMPT": "attempt", "OUTCOME": "outcome", "EXIT_CODE": "exit_code",
                 "SIGNAL": "signal", "DURATION": "duration", "HOST": "host",
                 "EVENT": "event", "COALESCED": "coalesced"}
        return {f"PERFECTSCHED_{n}": "" if d[k] is None else str(d[k])
                for n, k in names.items()}


def _duration(run: dict[str, Any]) -> float | None:
    if run.get("duration") is not None:
        return float(run["duration"])
    start, end = run.get("started_at"), run.get("finished_at")
    return round(float(end) - float(start), 3) if start is not None and end is not None \
        else None


def send(notifier: Notifier, message: Message, *, sendmail: str, user: str | None = None,
         refused: str | None = None) -> None:
    """`user`: who runs commands (None: this process's user); `refused`: why commands may
    not run here at all (Config.notify_as, .notify_refused)."""
    if notifier.kind in ("exec", "mail") and refused is not None:
        raise SendError(refused)
    if notifier.kind == "exec":
        assert isinstance(notifier.target, tuple)
        send_exec(notifier.target, message, user)
    elif notifier.kind == "mail":
        assert isinstance(notifier.target, str)
        send_mail(notifier.target, message, sendmail, user)
    elif notifier.kind == "webhook":
        try:
            url, token = webhook_secrets(notifier)
        except ValueError as exc:
            raise SendError(str(exc)) from None
        send_webhook(url, message, token=token)
    else:
        raise SendError(f"unknown notifier kind {notifier.kind!r}")


def _run(argv: list[str] | tuple[str, ...], stdin: bytes, env: dict[str, str],
         timeout: float, user: str | None = None) -> None:
    try:
        pw = runas.account(user)
        env = {**runas.job_environment(pw), **env}
        as_user = runas.as_user_args(pw)
        # A session of its own: a timeout kills the notifier's whole group, not only it.
        # Known as ours: in the master, its sweep kills children no worker accounts for.
        proc = reaper.start_helper(lambda: subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, start_new_session=True, close_fds=True, **as_user))
    except OSError as exc:
        raise SendError(f"cannot run {argv[0]}: {exc.strerror}") from None
    try:
        _, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise SendError(f"{argv[0]} did not end within {timeout:g}s (killed)") from None
    finally:
        reaper.end_helper(proc.pid)
    if proc.returncode != 0:
        said = err.decode("utf-8", "replace").strip().splitlines()
        tail = f": {said[-1][:_ERROR_TAIL]}" if said else ""
        raise SendError(f"{argv[0]} exited with status {proc.returncode}{tail}")


def send_exec(argv: tuple[str, ...], message: Message, user: str | None = None) -> None:
    """The command, as `user` (None: the daemon's user), with the run in PERFECTSCHED_*
    and the output tail on stdin."""
    _run(argv, message.output().encode("utf-8", "replace"), message.environment(),
         EXEC_TIMEOUT, user)


def send_mail(address: str, message: Message, sendmail: str, user: str | None = None
              ) -> None:
    """As cron mails: `sendmail -t` reads the recipients from the headers; -oi so that a
    line holding a single dot does not end the message early."""
    mail = email.message.EmailMessage()
    mail["To"] = address
    mail["Subject"] = message.subject()
    mail["Date"] = email.utils.formatdate(localtime=True)
    mail["X-Perfectsched-Key"] = str(message.run.get("key"))
    d = message.document()
    lines = [f"{k}: {d[k]}" for k in ("event", "key", "type", "scheduled_time", "attempt",
                                       "outcome", "exit_code", "signal", "duration",
                                       "host", "error") if d[k] is not None]
    out = message.output()
    body = "\n".join(lines) + ("\n\noutput (tail):\n" + out if out else "") + "\n"
    mail.set_content(body)
    _run([sendmail, "-t", "-oi"], mail.as_bytes(), {}, MAIL_TIMEOUT, user)


def send_webhook(url: str, message: Message, timeout: float = WEBHOOK_TIMEOUT,
                 token: str | None = None) -> None:
    """POST the JSON document; 2xx is delivered.  A redirect is followed only to the same
    scheme, host and port (307/308: the POST stays a POST): a receiver cannot send the
    run's output, or the token (`Authorization: Bearer`), to another host."""
    body = json.dumps(message.document(), separators=(",", ":")).encode()
    origin = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json",
               "User-Agent": f"perfectsched/{__version__}"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    for _ in range(REDIRECTS_MAX + 1):
        status, location = _post(url, body, timeout, headers)
        if 200 <= status < 300:
            return
        if status in (307, 308) and location:
            target = urllib.parse.urlsplit(urllib.parse.urljoin(url, location))
            if (target.scheme, target.hostname, target.port) != \
                    (origin.scheme, origin.hostname, origin.port):
                raise SendError(f"webhook: HTTP {status} redirect to another host "
                                f"({target.hostname}) not followed")
            url = target.geturl()
            continue
        if 300 <= status < 400:
            raise SendError(f"webhook: HTTP {status} redirect not followed")
        raise SendError(f"webhook: HTTP {status}")
    raise SendError(f"webhook: more than {REDIRECTS_MAX} redirects")


def _post(url: str, body: bytes, timeout: float,
          headers: dict[str, str]) -> tuple[int, str | None]:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else \
        http.client.HTTPConnection
    assert parts.hostname is not None
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read(65536)  # a bounded read: the answer's body means nothing to us
        return resp.status, resp.getheader("Location")
    except (OSError, http.client.HTTPException) as exc:
        raise SendError(f"webhook: {type(exc).__name__}: {exc}"[:_ERROR_TAIL]) from None
    finally:
        conn.close()
