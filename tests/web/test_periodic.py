"""/periodic/ against a real daemon over real HTTP (SPEC "HTTP API and web console"):
Periodic's README curl lines, run with curl as written plus a token, submit, replace,
show and remove jobs and drop funcs; a job runs at its sched_at; the rules of the socket
hold (roles, a routed func is not dropped, schedules files own their schedules); bad
input is one JSON line and stores nothing."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from api_client import call, make_token
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until

pytestmark = pytest.mark.slow_on_servers

# Periodic's README, "Periodic clients", "http client api" (github.com/Lupino/periodic),
# as written: only http://ip:port becomes this daemon's /periodic.
README = {
    "status": "curl http://ip:port",
    "func": "curl http://ip:port/[funcName]",
    "drop": "curl -X DELETE http://ip:port/[funcName]",
    "submit": "curl -d func=[funcName] -d name=[jobName] -d args=[jobArgs] -d "
              "timeout=[timeout] -d sched_at=[schedAt] http://ip:port",
    "submit_to_func": "curl -d name=[jobName] -d args=[jobArgs] -d timeout=[timeout] -d "
                      "sched_at=[schedAt] http://ip:port/[funcName]",
    "remove": "curl -d name=[jobName] -d act=remove http://ip:port/[funcName]",
    "remove_with_func": "curl -d name=[jobName] -d func=[funcName] -d act=remove "
                        "http://ip:port/[funcName]",
}


def curl(d: Daemon, token: str, line: str, **values: Any) -> tuple[int, Any]:
    """One README line, its [placeholders] filled in, with the token's header added: the
    status and the JSON answer."""
    if shutil.which("curl") is None:
        pytest.fail("curl is needed (apt-get install curl)")
    text = README[line].replace("http://ip:port", f"http://127.0.0.1:{d.metrics_port}/periodic")
    for name, value in values.items():
        text = text.replace(f"[{name}]", str(value))
    assert "[" not in text, text
    argv = shlex.split(text)
    argv[1:1] = ["-sS", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {token}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    body, _, code = out.rpartition("\n")
    answer = json.loads(body)
    if int(code) >= 400:
        assert set(answer) == {"error"} and "\n" not in answer["error"], answer
    return int(code), answer


def start(daemon_factory: Any, tmp_path: Path, url: str | None = None,
          **overrides: Any) -> Daemon:
    marks, go = tmp_path / "ran", tmp_path / "go"
    # The control group's routes (allow: @root, the group of this test's daemon): an
    # operator token schedules them.
    routes = [sh("ls5", f"printf '%s %s %s\\n' \"$1\" \"$(date +%s)\" \"$(cat)\" >> {marks}",
                 allow=["@root"]),
              sh("slow", f"while [ ! -e {go} ]; do sleep 0.1; done", allow=["@root"])]
    return daemon_factory({"routes": routes, "workers": 2, "poll_interval": 0.2,
                           **overrides}, url=url).start()


def ran(tmp_path: Path) -> list[tuple[str, int, Any]]:
    out = []
    for line in lines(tmp_path / "ran"):
        key, at, data = line.split(" ", 2)
        out.append((key, int(at), json.loads(data)))
    return out


def stored(d: Daemon) -> list[dict[str, Any]]:
    return [{k: r[k] for k in ("key", "type", "cron", "next_run_time", "data", "timeout")}
            for r in d.ctl_json("list")]


def test_the_readme_curl_lines(daemon_factory: Any, db_url: str, tmp_path: Path) -> None:
    d = start(daemon_factory, tmp_path, db_url)
    token = make_token(d, "periodic-client", "operator")
    later = int(time.time()) + 3600

    # Submit (func in the body), then submit again to the func's path: replaced in place.
    code, answer = curl(d, token, "submit", funcName="ls5", jobName="/tmp/", jobArgs="-l",
                        timeout=30, schedAt=later)
    assert code == 200 and answer["msg"] == "SUCCESS" and answer["replaced"] is False
    shown = d.ctl_json("show", "ls5:/tmp/")
    assert (shown["type"], shown["cron"], shown["data"], shown["timeout"],
            shown["next_run_time"]) == ("ls5", "@once", {"args": "-l"}, 30, later)
    assert shown["creator_name"] == "token periodic-client"
    soon = int(time.time()) + 3
    code, answer = curl(d, token, "submit_to_func", funcName="ls5", jobName="/tmp/",
                        jobArgs="-a", timeout=0, schedAt=soon)
    assert code == 200 and answer == {"msg": "SUCCESS", "key": "ls5:/tmp/",
                                      "sched_at": soon, "replaced": True}
    shown = d.ctl_json("show", "ls5:/tmp/")
    assert (shown["data"], shown["timeout"], shown["next_time"], shown["next_run_time"]) \
        == ({"args": "-a"}, None, soon, soon)
    # It runs once, at sched_at, with the new args; a one-off is gone once it ran.
    ((key, at, data),) = wait_until(lambda: ran(tmp_path), what="the job's run")
    assert (key, data) == ("ls5:/tmp/", {"args": "-a"}) and at >= soon
    wait_until(lambda: d.ctl("show", "ls5:/tmp/", check=False).returncode != 0,
               what="the one-off removed once it ran")

    # Jobs of a func no route of this host runs (they wait), and one schedule of that
    # type added otherwise.
    for name in ("a", "b", "c"):
        assert curl(d, token, "submit_to_func", funcName="idle", jobName=name,
                    jobArgs=name, timeout=5, schedAt=later)[0] == 200
    d.ctl("add", "nightly-idle", "idle", YEARLY)

    # The status of every func, then of one.
    code, funcs = curl(d, token, "status")
    assert code == 200
    assert funcs["idle"] == {"func_name": "idle", "total_worker": 0, "total_job": 4,
                             "processing": 0}
    assert funcs["ls5"] == {"func_name": "ls5", "total_worker": 2, "total_job": 0,
                            "processing": 0}
    assert funcs["slow"]["total_worker"] == 2  # a route's func, with no job yet
    assert curl(d, token, "func", funcName="idle") == (200, funcs["idle"])
    code, answer = curl(d, token, "func", funcName="nothing-here")
    assert code == 404 and "no func" in answer["error"]

    # Remove (the func in the path, then in both).
    assert curl(d, token, "remove", funcName="idle", jobName="a")[0] == 200
    assert curl(d, token, "remove_with_func", funcName="idle", jobName="b")[0] == 200
    code, answer = curl(d, token, "remove", funcName="idle", jobName="a")
    assert code == 404
    assert curl(d, token, "func", funcName="idle")[1]["total_job"] == 2

    # A func a live worker takes is not dropped: routed here, and running now.
    assert curl(d, token, "submit_to_func", funcName="slow", jobName="x", jobArgs="",
                timeout=60, schedAt=0)[0] == 200
    wait_until(lambda: curl(d, token, "func", funcName="slow")[1]["processing"] == 1,
               what="the slow job processing")
    code, answer = curl(d, token, "drop", funcName="slow")
    assert code == 409 and "routes it to its 2 workers" in answer["error"]
    assert "slow:x" in [r["key"] for r in d.ctl_json("list")]
    (tmp_path / "go").touch()

    # Drop: every schedule of the type goes, whatever its key.
    code, answer = curl(d, token, "drop", funcName="idle")
    assert code == 200 and answer == {"msg": "SUCCESS", "func": "idle", "deleted": 2}
    assert curl(d, token, "func", funcName="idle")[0] == 404
    assert [r["key"] for r in d.ctl_json("list") if r["type"] == "idle"] == []
    assert d.stop() == 0


def test_roles_and_bad_input(daemon_factory: Any, tmp_path: Path) -> None:
    files = tmp_path / "schedules.d"
    files.mkdir()
    (files / "f.yml").write_text("- {key: 'ls5:filed', type: ls5, cron: '@daily'}\n"
                                 "- {key: 'kept:one', type: kept, cron: '@daily'}\n")
    (files / "f.yml").chmod(0o644)
    d = start(daemon_factory, tmp_path, schedules_dir=str(files))
    wait_until(lambda: d.ctl("show", "kept:one", check=False).returncode == 0,
               what="the file's schedules")
    port = d.metrics_port
    viewer = make_token(d, "dash", "viewer")
    operator = make_token(d, "ci", "operator")
    later = int(time.time()) + 3600
    d.ctl("add", "ls5:taken", "other", YEARLY)
    before = stored(d)

    def form(token: str | None, path: str, body: str, ctype: str =
             "application/x-www-form-urlencoded", method: str = "POST") -> Any:
        return call(port, method, path, token, raw=body.encode(),
                    headers={"Content-Type": ctype})

    # A viewer reads, and changes nothing (403 before anything is looked at).
    assert call(port, "GET", "/periodic/", viewer).status == 200
    for a in (form(viewer, "/periodic/", f"func=ls5&name=v&sched_at={later}"),
              form(viewer, "/periodic/ls5", "name=taken&act=remove"),
              call(port, "DELETE", "/periodic/nothing", viewer)):
        assert a.status == 403 and "role viewer" in a.error, a.body
    # No credentials: 401.
    assert form(None, "/periodic/", "func=ls5&name=v").status == 401

    # Bad input: 400 in one line naming the field; nothing stored.
    for path, body, says in (
            ("/periodic/", "name=x", "func: required"),
            ("/periodic/ls5", "args=x", "name: required"),
            ("/periodic/ls5", "name=x&sched_at=tomorrow", "sched_at"),
            ("/periodic/ls5", "name=x&sched_at=-5", "sched_at"),
            ("/periodic/ls5", "name=x&sched_at=1.5", "sched_at"),
            ("/periodic/ls5", "name=x&timeout=soon", "timeout"),
            ("/periodic/ls5", "name=x&colour=red", "colour: unknown field"),
            ("/periodic/ls5", "name=x&name=y", "name: given twice"),
            ("/periodic/ls5", "name=x&act=drop", "act"),
            ("/periodic/ls5", "func=idle&name=x", "func"),
            ("/periodic/ls5", "name=with space", "key"),
            ("/periodic/exec:x", "name=x", "exec:"),
            ("/periodic/ls5", "name=%ff", "body")):
        a = form(operator, path, body)
        assert a.status == 400 and says in a.error, (path, body, a.status, a.body)
    a = form(operator, "/periodic/ls5", "{not json", "application/json")
    assert a.status == 400 and "JSON object" in a.error
    a = form(operator, "/periodic/ls5", '{"name": 5}', "application/json")
    assert a.status == 400 and "name: must be text" in a.error
    a = form(operator, "/periodic/ls5", "name=x", "text/plain")
    assert a.status == 415 and "application/json" in a.error
    a = call(port, "PUT", "/periodic/ls5", operator)
    assert a.status == 405 and a.headers["Allow"] == "DELETE, GET, HEAD, POST"
    # A key held by a schedule of another type, a schedules file's schedule: 409.
    a = form(operator, "/periodic/ls5", f"name=taken&sched_at={later}")
    assert a.status == 409 and "type other" in a.error
    a = form(operator, "/periodic/ls5", "name=taken&act=remove")
    assert a.status == 409 and "type other" in a.error
    a = form(operator, "/periodic/ls5", f"name=filed&sched_at={later}")
    assert a.status == 409 and "managed by" in a.error
    a = call(port, "DELETE", "/periodic/kept", operator)
    assert a.status == 409 and "schedules files" in a.error and "kept:one" in a.error
    assert call(port, "DELETE", "/periodic/", operator).status == 400
    assert stored(d) == before

    # JSON works as the form does; args may be any JSON value there.
    a = call(port, "POST", "/periodic/", operator, {"func": "ls5", "name": "j",
                                                     "args": {"n": 1}, "sched_at": later})
    assert a.status == 200 and a.json["key"] == "ls5:j"
    assert d.ctl_json("show", "ls5:j")["data"] == {"args": {"n": 1}}
    wait_until(lambda: "token ci (operator) POST /periodic/ -> 200" in d.log(),
               what="the operator's submit in the log")
    assert d.stop() == 0
