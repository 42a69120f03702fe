"""/api/v1/ against a real daemon over real HTTP (SPEC "HTTP API and web console"): every
route, each role's rights through the same rules as the control socket, and every error
as one JSON line with its status; bad input changes nothing stored."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from api_client import Answer, call, make_token
from daemon_harness import YEARLY, Daemon, sh, wait_until

# The PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers


def start(daemon_factory: Any, url: str | None = None, **overrides: Any) -> Daemon:
    routes = [sh("t", "echo out-of-$1; echo '<script>alert(1)</script>'"),
              sh("fails", "echo broken >&2; exit 3"),
              # The control group's route (allow: @root: the group of this test's daemon).
              sh("ops", "echo ops", allow=["@root"])]
    return daemon_factory({"routes": routes, "workers": 1, "poll_interval": 0.2,
                           **overrides}, url=url).start()


def path_of(key: str, *rest: str) -> str:
    return "/api/v1/schedules/" + "/".join([urllib.parse.quote(key, safe=""), *rest])


def test_every_route_for_an_admin(daemon_factory: Any, db_url: str) -> None:
    d = start(daemon_factory, db_url)
    port = d.metrics_port
    admin = make_token(d, "deploy-bot", "admin")

    # add: every option by its long name, '-' or '_' alike; 201 and the row.
    added = call(port, "POST", "/api/v1/schedules", admin, {
        "key": "backup/db", "type": "t", "cron": "0 3 * * *", "data": {"db": "main"},
        "timezone": "Europe/Paris", "max-attempts": 2, "retry_wait": 5, "jitter": 0,
        "misfire": "latest", "concurrency": "forbid"})
    assert added.status == 201, added.body
    row = added.json
    assert (row["key"], row["timezone"], row["max_attempts"], row["misfire"]) == (
        "backup/db", "Europe/Paris", 2, "latest")
    assert row["creator_name"] == "token deploy-bot"
    # The same through the socket: one registry, one store.
    shown = json.loads(d.ctl("--json", "show", "backup/db").stdout)
    assert shown["cron"] == "0 3 * * *" and shown["creator"] == row["creator"] < 0

    got = call(port, "GET", path_of("backup/db"), admin)
    assert got.status == 200 and got.json["data"] == {"db": "main"}
    assert got.headers["Content-Type"] == "application/json"

    patched = call(port, "PATCH", path_of("backup/db"), admin, {"cron": "0 4 * * *"})
    assert patched.status == 200 and patched.json["cron"] == "0 4 * * *"

    nxt = call(port, "GET", path_of("backup/db", "next") + "?n=3", admin)
    assert nxt.status == 200 and len(nxt.json["times"]) == 3
    assert nxt.json["times"][0]["scheduled_local"].endswith("T04:00:00+01:00") or \
        nxt.json["times"][0]["scheduled_local"].endswith("T04:00:00+02:00")
    expr = call(port, "GET", "/api/v1/next?cron=0+9+*+*+*&timezone=UTC&n=2", admin)
    assert expr.status == 200 and [t["scheduled_local"][11:] for t in expr.json["times"]] \
        == ["09:00:00+00:00"] * 2

    assert call(port, "POST", path_of("backup/db", "pause"), admin).json["paused"] is True
    paused = call(port, "GET", "/api/v1/schedules?state=paused", admin).json
    assert [i["key"] for i in paused["items"]] == ["backup/db"] and paused["next"] is None
    assert call(port, "POST", path_of("backup/db", "resume"), admin).status == 200

    ran = call(port, "POST", path_of("backup/db", "run"), admin)
    assert ran.status == 200 and ran.json["run_key"].startswith("backup/db@run-")
    runs = wait_until(lambda: call(port, "GET", path_of("backup/db", "runs"), admin
                                   ).json["items"], what="the run in history")
    (run,) = runs
    assert (run["outcome"], run["exit_code"]) == ("success", 0)
    assert run["duration"] is not None and run["duration"] >= 0
    output = call(port, "GET", path_of(run["key"], "runs", str(run["scheduled_time"]),
                                       str(run["attempt"]), "output"), admin)
    assert output.status == 200 and output.headers["Content-Type"].startswith("text/plain")
    assert output.body.decode().startswith(f"out-of-{run['key']}\n")

    status = call(port, "GET", "/api/v1/status", admin)
    assert status.status == 200 and status.json["workers_alive"] == 1

    assert call(port, "DELETE", path_of("backup/db"), admin).status == 204
    assert call(port, "GET", path_of("backup/db"), admin).status == 404
    assert d.ctl("show", "backup/db", check=False).returncode != 0
    assert d.stop() == 0


def test_pages_follow_the_keys_and_stop(daemon_factory: Any) -> None:
    d = start(daemon_factory)
    admin = make_token(d, "a", "admin")
    d.ctl_json("add", "p0", "t", YEARLY)  # outside the prefix
    for i in range(7):
        d.ctl("add", f"q{i}", "t", YEARLY)
    d.ctl("pause", "q2", "q5")
    seen: list[str] = []
    after = ""
    while True:
        page = call(d.metrics_port, "GET", f"/api/v1/schedules?prefix=q&limit=3&after={after}",
                    admin).json
        seen += [i["key"] for i in page["items"]]
        assert len(page["items"]) <= 3
        if page["next"] is None:
            break
        after = page["next"]
    assert seen == [f"q{i}" for i in range(7)]
    paused = call(d.metrics_port, "GET", "/api/v1/schedules?prefix=q&state=paused&limit=1",
                  admin).json
    assert [i["key"] for i in paused["items"]] == ["q2"] and paused["next"] == "q2"
    rest = call(d.metrics_port, "GET", "/api/v1/schedules?prefix=q&state=paused&limit=5"
                "&after=q2", admin).json
    assert [i["key"] for i in rest["items"]] == ["q5"] and rest["next"] is None
    assert d.stop() == 0


def test_roles_and_errors(daemon_factory: Any, tmp_path: Path) -> None:
    d = start(daemon_factory)
    port = d.metrics_port
    viewer = make_token(d, "dash", "viewer")
    operator = make_token(d, "ci", "operator")
    admin = make_token(d, "root-ish", "admin")
    d.ctl("add", "roots", "t", YEARLY, '{"secret": "s3"}', "--at", "0")
    wait_until(lambda: d.ctl_json("history", "roots"), what="root's run")

    def stored() -> str:
        return d.ctl("--json", "list").stdout

    before = stored()
    # No credentials, bad ones: 401 with a challenge; nothing changes.
    altered = viewer[:-1] + ("A" if viewer[-1] != "A" else "B")  # one character off
    for token in (None, "pst_1_" + "x" * 43, "nonsense", altered):
        a = call(port, "POST", "/api/v1/schedules", token,
                 {"key": "x", "type": "ops", "cron": YEARLY})
        assert a.status == 401 and a.headers["WWW-Authenticate"].startswith("Bearer"), a.body
        a.error  # noqa: B018 - one JSON line
    # A viewer reads keys and states, never data or output, and changes nothing.
    listed = call(port, "GET", "/api/v1/schedules", viewer).json["items"]
    assert [(i["key"], i["data"]) for i in listed] == [("roots", None)]
    assert "withheld" in listed[0]
    (run,) = call(port, "GET", path_of("roots", "runs"), viewer).json["items"]
    assert run["output"] is None and run["exit_code"] == 0
    out = call(port, "GET", path_of("roots", "runs", str(run["scheduled_time"]), "1",
                                    "output"), viewer)
    assert out.status == 403 and "withheld" in out.error
    for method, path, body in (("POST", "/api/v1/schedules", {"key": "v", "type": "ops",
                                                              "cron": YEARLY}),
                               ("POST", path_of("roots", "pause"), None),
                               ("POST", path_of("roots", "run"), None),
                               ("PATCH", path_of("roots"), {"cron": "@daily"}),
                               ("DELETE", path_of("roots"), None)):
        a = call(port, method, path, viewer, body)
        assert a.status == 403 and "role viewer" in a.error, (method, path, a.body)
    # An operator: a control-group member.  Root's route (user: root, no allow:) is
    # refused; the group's route is its own; root's schedule's data is not its to read.
    a = call(port, "POST", "/api/v1/schedules", operator, {"key": "o1", "type": "t",
                                                            "cron": YEARLY})
    assert a.status == 403 and "token ci" in a.error
    assert call(port, "GET", path_of("roots"), operator).json["data"] is None
    assert call(port, "POST", path_of("roots", "pause"), operator).status == 403
    assert stored() == before
    a = call(port, "POST", "/api/v1/schedules", operator, {"key": "o1", "type": "ops",
                                                            "cron": YEARLY, "data": {"n": 1}})
    assert a.status == 201 and a.json["data"] == {"n": 1}
    # exists: 409; bad input: 400 naming the field; unknown option: 400; not JSON: 400.
    before = stored()
    for body, status, says in (
            ({"key": "o1", "type": "ops", "cron": YEARLY}, 409, "exists"),
            ({"key": "o2", "type": "ops", "cron": "61 * * * *"}, 400, "cron"),
            ({"key": "o2", "type": "ops", "cron": YEARLY, "retries": 3}, 400, "retries"),
            ({"key": "o2", "type": "exec:x", "cron": YEARLY}, 400, "exec:"),
            ([1, 2], 400, "JSON object")):
        a = call(port, "POST", "/api/v1/schedules", operator, body)
        assert a.status == status and says in a.error, (body, a.status, a.body)
    a = call(port, "POST", "/api/v1/schedules", operator, raw=b"{not json")
    assert a.status == 400 and "JSON object" in a.error
    assert call(port, "GET", path_of("nope"), operator).status == 404
    assert call(port, "GET", "/api/v1/nothing-here", operator).status == 404
    a = call(port, "PUT", path_of("o1"), operator)
    assert a.status == 405 and a.headers["Allow"] == "DELETE, GET, PATCH"
    a = call(port, "GET", "/api/v1/schedules?limit=1001", operator)
    assert a.status == 400 and "limit" in a.error
    a = call(port, "GET", "/api/v1/schedules?state=sleepy", operator)
    assert a.status == 400 and "state" in a.error
    a = call(port, "GET", "/api/v1/status?fresh=maybe", operator)
    assert a.status == 400 and "fresh" in a.error
    assert call(port, "GET", "/api/v1/status?fresh=true", operator).status == 200
    # A body over 1 MiB: 413 from its Content-Length, before it is sent.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /api/v1/schedules HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  f"{operator}\r\nContent-Length: {1024 * 1024 + 1}\r\n\r\n".encode())
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413 "), head
    assert stored() == before
    # An admin has root's schedule rights: root's route, root's data.
    assert call(port, "GET", path_of("roots"), admin).json["data"] == {"secret": "s3"}
    a = call(port, "POST", "/api/v1/schedules", admin, {"key": "a1", "type": "t",
                                                         "cron": YEARLY})
    assert a.status == 201
    # What a token did is in the log, under its name.
    wait_until(lambda: "token root-ish (admin) POST /api/v1/schedules -> 201" in d.log(),
               what="the admin's add in the log")
    assert viewer not in d.log() and admin not in d.log()
    assert d.stop() == 0


def test_a_schedules_file_owns_its_schedule_409(daemon_factory: Any, tmp_path: Path) -> None:
    files = tmp_path / "schedules.d"
    files.mkdir()
    (files / "f.yml").write_text("- {key: filed, type: ops, cron: '@daily'}\n")
    (files / "f.yml").chmod(0o644)
    d = start(daemon_factory, schedules_dir=str(files))
    wait_until(lambda: d.ctl("show", "filed", check=False).returncode == 0,
               what="the file's schedule")
    operator = make_token(d, "ci", "operator")
    a = call(d.metrics_port, "PATCH", path_of("filed"), operator, {"cron": "@hourly"})
    assert a.status == 409 and "managed by" in a.error
    assert d.stop() == 0


def test_throttle_revocation_and_expiry(daemon_factory: Any) -> None:
    d = start(daemon_factory)
    port = d.metrics_port
    good = make_token(d, "good", "viewer")
    short = make_token(d, "short", "viewer", expires_in=3)
    assert call(port, "GET", "/api/v1/status", short).status == 200
    # Ten bad credentials from one address within a minute: 429, even for a good token.
    for _ in range(10):
        assert call(port, "GET", "/api/v1/status", "pst_9_" + "y" * 43).status == 401
    a = call(port, "GET", "/api/v1/status", good)
    assert a.status == 429 and "too many bad credentials" in a.error
    # A token this address proved before goes on working: loopback is every local
    # user's address, and one guessing must not lock the others out.
    assert call(port, "GET", "/api/v1/status", short).status == 200
    assert call(port, "GET", "/api/v1/status").status == 429
    d.wait_log("10 bad credentials from 127.0.0.1")  # the log's writer thread: wait
    # The socket is not throttled.
    assert d.ctl("status").returncode == 0
    # Two hosts of one database: a token revoked on one is refused by the other within
    # 5 s (and the other throttles only what it saw).
    d2 = start(daemon_factory, url=d.config["url"], node_name="host-two")
    assert call(d2.metrics_port, "GET", "/api/v1/status", good).status == 200
    assert "revoked" in d.ctl("token", "revoke", "good").stdout
    started = time.monotonic()
    wait_until(lambda: call(d2.metrics_port, "GET", "/api/v1/status", good).status == 401,
               timeout=10, what="the revoked token refused")
    assert time.monotonic() - started < 5.5
    assert "revoked" in call(d2.metrics_port, "GET", "/api/v1/status", good).error
    wait_until(lambda: call(d2.metrics_port, "GET", "/api/v1/status", short).status == 401,
               timeout=10, what="the expired token refused")
    assert "expired" in call(d2.metrics_port, "GET", "/api/v1/status", short).error
    assert d2.stop() == 0 and d.stop() == 0


def test_security_headers_and_metrics_token(daemon_factory: Any) -> None:
    d = start(daemon_factory, metrics_token=True)
    port = d.metrics_port
    viewer = make_token(d, "prom", "viewer")
    a = call(port, "GET", "/metrics")
    assert a.status == 401
    a = call(port, "GET", "/metrics", viewer)
    assert a.status == 200 and b"perfectsched_workers" in a.body
    for header, value in (("Content-Security-Policy", "default-src 'none'"),
                          ("X-Content-Type-Options", "nosniff"),
                          ("Cache-Control", "no-store"), ("X-Frame-Options", "DENY")):
        assert value in (a.headers[header] or ""), (header, a.headers)
    assert call(port, "GET", "/healthz").status == 401
    assert call(port, "GET", "/healthz", viewer).status == 200
    assert d.stop() == 0


def test_not_loopback_without_tls_serves_metrics_but_no_api(daemon_factory: Any) -> None:
    d = daemon_factory({"routes": [sh("t", "true")]})
    d.config["http_listen"] = d.config.pop("metrics_listen").replace("127.0.0.1", "0.0.0.0")
    d.write_config()
    d.start()
    viewer = make_token(d, "v", "viewer")
    assert call(d.metrics_port, "GET", "/metrics").status == 200
    a = call(d.metrics_port, "GET", "/api/v1/status", viewer)
    assert a.status == 403 and "http_tls" in a.error and "http_insecure" in a.error
    d.wait_log("http_listen: the API is off on 0.0.0.0 without TLS")
    d.stop()
    d.config["http_insecure"] = True
    d.write_config()
    d.start()
    assert call(d.metrics_port, "GET", "/api/v1/status", viewer).status == 200
    assert d.stop() == 0


def test_both_names_of_the_listener_refused_in_one_line(daemon_factory: Any) -> None:
    d = daemon_factory({"http_listen": "127.0.0.1:1"})
    d.start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(30) != 0
    (line,) = [x for x in d.log().splitlines() if "http_listen" in x]
    assert "http_listen and metrics_listen (its old name) are both set" in line


def answers(d: Daemon, port: int, token: str) -> Answer:
    return call(port, "GET", "/api/v1/status", token)


def test_a_token_made_meanwhile_is_known_at_once_and_runs_by_attempt(
        daemon_factory: Any) -> None:
    d = start(daemon_factory)
    first = make_token(d, "first", "viewer")
    conn_answer = call(d.metrics_port, "GET", "/api/v1/status", first)
    assert conn_answer.status == 200
    # Made after the listener read the tokens: known without waiting for the next read.
    second = make_token(d, "second", "viewer")
    assert call(d.metrics_port, "GET", "/api/v1/status", second).status == 200
    # runs by attempt.
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: d.ctl_json("history", "k"), what="the run")
    assert len(call(d.metrics_port, "GET", path_of("k", "runs") + "?attempt=1", first
                    ).json["items"]) == 1
    assert call(d.metrics_port, "GET", path_of("k", "runs") + "?attempt=2", first
                ).json["items"] == []
    assert d.stop() == 0


def test_a_reload_on_the_same_address_changes_the_listener_in_place(
        daemon_factory: Any) -> None:
    """The same port with other settings (metrics_token, http_insecure, http_tls): the
    listener takes them (a second listener could not bind the port the first holds)."""
    d = start(daemon_factory)
    port = d.metrics_port
    viewer = make_token(d, "prom", "viewer")
    assert call(port, "GET", "/metrics").status == 200
    d.config["metrics_token"] = True
    d.write_config()
    res = d.ctl("reload", check=False)
    assert res.returncode == 0, res.stderr
    assert call(port, "GET", "/metrics").status == 401
    assert call(port, "GET", "/metrics", viewer).status == 200
    # A wrong value: one line, the listener as it was.
    d.config["metrics_token"] = "yes"
    d.write_config()
    res = d.ctl("reload", check=False)
    assert res.returncode != 0 and "metrics_token: must be true or false" in res.stderr
    assert call(port, "GET", "/metrics").status == 401
    del d.config["metrics_token"]
    d.write_config()
    assert d.ctl("reload", check=False).returncode == 0
    assert call(port, "GET", "/metrics").status == 200
    assert d.stop() == 0
