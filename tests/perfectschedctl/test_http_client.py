"""perfectschedctl --url (perfectschedctl/http_client.py) against a real daemon's HTTP
API: the schedule commands print what they print over the socket (text and --json) and
exit as they exit there, refusals included, in the same one line; what cannot go over
--url, a missing or bad token, a daemon out of reach are one line each; HTTPS with a
throw-away CA."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, free_port, sh, wait_until

from perfectschedctl import http_client
from perfectschedctl.client import SocketClient
from perfectschedd import ConfigError
from perfectschedd.control import protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "web"))
from api_client import make_token  # noqa: E402

Result = subprocess.CompletedProcess
Ctl = Callable[..., "Result[str]"]


def start(daemon_factory: Any, **overrides: Any) -> Daemon:
    routes = [sh("t", "echo out-of-$1; printf 'two\\nthree\\n'"),
              sh("fails", "echo broken >&2; exit 3"),
              # The control group's route (allow: @root: the group of this test's daemon).
              sh("ops", "echo ops", allow=["@root"])]
    return daemon_factory({"routes": routes, "workers": 1, "poll_interval": 0.2,
                           **overrides}).start()


def token_file(d: Daemon, tmp_path: Path, name: str, role: str) -> str:
    path = tmp_path / f"{name}.token"
    path.write_text(make_token(d, name, role) + "\n")
    path.chmod(0o600)
    return str(path)


def one_line(res: Result[str], status: int = 1, *texts: str) -> str:
    """Exit `status`, nothing on stdout, one line on stderr holding every text."""
    assert res.returncode == status, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == "" and res.stderr.count("\n") == 1, (res.stdout, res.stderr)
    assert res.stderr.startswith("perfectschedctl: "), res.stderr
    for text in texts:
        assert text in res.stderr, (text, res.stderr)
    return res.stderr


def same(a: Result[str], b: Result[str]) -> None:
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr), \
        (a.args, b.args)


def test_reads_print_as_over_the_socket(daemon_factory: Any, tmp_path: Path, ctl: Ctl
                                        ) -> None:
    d = start(daemon_factory)
    sock = ["--socket", d.socket_path]
    url = ["--url", f"http://127.0.0.1:{d.metrics_port}",
           "--token-file", token_file(d, tmp_path, "admin", "admin")]
    for i in range(3):
        # Times that do not come during the test: its reads see nothing move.
        d.ctl("add", f"a/{i}", "t", "5 4 3 2 *", json.dumps({"i": i}), "-t", "Asia/Tokyo",
              "-d", str(i))
    d.ctl("add", "b.x", "t", "0 6 9 9 *", "--max-attempts", "2", "--jitter", "30")
    d.ctl("pause", "a/1")
    d.ctl("add", "t/1", "t", YEARLY, "--at", "0")
    d.ctl("add", "t/bad", "fails", YEARLY, "--at", "0")
    wait_until(lambda: all(d.ctl_json("history", k) and d.ctl_json("show", k)["owner"]
                           is None for k in ("t/1", "t/bad")), what="both runs ended")
    d.ctl("run", "t/1")
    wait_until(lambda: len(d.ctl_json("history", "t/1")) == 2
               and d.ctl_json("list", "--prefix", "t/1@") == [], what="the extra run")

    for args in (["list"], ["list", "--json"], ["--json", "list"], ["list", "-n", "2"],
                 ["list", "--prefix", "a/"], ["list", "--prefix", "a/", "-n", "1", "--json"],
                 ["list", "--prefix", "none"], ["show", "a/1"], ["show", "--json", "b.x"],
                 ["history", "t/1"], ["history", "--json", "t/1"], ["history", "-n", "1",
                                                                      "t/bad"],
                 ["history", "t/bad", "--json"], ["next", "a/2"],
                 ["next", "--json", "b.x", "-n", "3"], ["next", "--cron", "0 9 * * *"],
                 ["logs", "t/1"], ["logs", "--attempt", "1", "t/1"], ["logs", "-n", "1",
                                                                      "t/1"],
                 ["logs", "t/bad"]):
        s, u = ctl(*sock, *args), ctl(*url, *args)
        assert s.returncode == 0, (args, s.stderr)
        same(s, u)
    assert "out-of-t/1" in ctl(*url, "logs", "t/1").stdout

    # status: the same but for what moves between two calls.
    def normal(status: dict[str, Any]) -> dict[str, Any]:
        for w in status.get("workers") or []:
            w.pop("age")
            w.pop("last_seen")  # seconds since its last ping
        for h in status.get("hosts") or []:
            h.pop("last_seen")
        status["database"].pop("figures_age")
        return {k: v for k, v in status.items() if k not in ("uptime",)}

    s, u = ctl(*sock, "status", "--json"), ctl(*url, "status", "--json")
    assert u.returncode == 0 and u.stderr == ""
    assert normal(json.loads(u.stdout)) == normal(json.loads(s.stdout))

    def text(out: str) -> str:
        out = re.sub(r", up \d+s", ", up Ns", out)
        out = re.sub(r"(?m)^(\d+ +\d+ +\d+ +)[\d.]+", r"\1AGE", out)  # a worker's age
        return re.sub(r"(?m)\d\d:\d\d:\d\d(?= +(live|silent)$)", "SEEN", out)  # a host's

    s, u = ctl(*sock, "status"), ctl(*url, "status")
    assert u.returncode == 0 and text(u.stdout) == text(s.stdout)
    assert "workers: 1/1 alive" in u.stdout

    # Every page: more schedules than one page of the API holds.
    SocketClient(d.socket_path).call("add_many", {"schedules": [
        {"key": f"many/{i:04}", "type": "t", "cron": YEARLY} for i in range(1005)]})
    for args in (["list", "--json"], ["list", "--prefix", "many/", "-n", "1002"]):
        s, u = ctl(*sock, *args), ctl(*url, *args)
        same(s, u)
    assert len(json.loads(ctl(*url, "--json", "list").stdout)) == 1011
    assert d.stop() == 0


def test_changes_and_their_refusals_as_over_the_socket(daemon_factory: Any,
                                                       tmp_path: Path, ctl: Ctl) -> None:
    files = tmp_path / "schedules.d"
    files.mkdir()
    (files / "f.yml").write_text("- {key: filed, type: t, cron: '@daily'}\n")
    (files / "f.yml").chmod(0o644)
    d = start(daemon_factory, schedules_dir=str(files))
    wait_until(lambda: d.ctl("show", "filed", check=False).returncode == 0,
               what="the file's schedule")
    sock = ["--socket", d.socket_path]
    base = f"http://127.0.0.1:{d.metrics_port}"
    # Made before the first request: the daemon reads new tokens every 2 s.
    url = ["--url", base, "--token-file", token_file(d, tmp_path, "admin", "admin")]
    viewer = ["--url", base, "--token-file", token_file(d, tmp_path, "dash", "viewer")]
    operator = ["--url", base, "--token-file", token_file(d, tmp_path, "ci", "operator")]

    # add, every option by its long name; the same line as the socket's add prints.
    added = ctl(*url, "add", "k", "t", "30 3 * * *", '{"full": true}', "-t", "Europe/Paris",
                "-d", "5", "--misfire", "latest", "--max-attempts", "3", "--retry-wait",
                "7", "--grace", "60", "--concurrency", "allow", "--notify", "",
                "--metrics", "true", "-s", "1893456000")
    assert added.returncode == 0, added.stderr
    twin = ctl(*sock, "add", "twin", "t", "30 3 * * *", '{"full": true}', "-t",
               "Europe/Paris", "-d", "5", "--misfire", "latest", "--max-attempts", "3",
               "--retry-wait", "7", "--grace", "60", "--concurrency", "allow", "--notify",
               "", "--metrics", "true", "-s", "1893456000")
    assert added.stdout == twin.stdout.replace("twin", "k") and added.stderr == ""
    shown = d.ctl_json("show", "k")
    assert (shown["data"], shown["timezone"], shown["delay"], shown["misfire"],
            shown["max_attempts"], shown["retry_wait"], shown["grace"],
            shown["concurrency"], shown["metrics"], shown["creator_name"]) == (
        {"full": True}, "Europe/Paris", 5, "latest", 3, 7, 60, "allow", True,
        "token admin")
    # What changes nothing the second time prints the same either way.
    for args in (["modify", "k", "--cron", "0 4 * * *", "--data", '{"n": 2}'],
                 ["modify", "k", "--json", "--timeout", "90"],
                 ["pause", "k"], ["pause", "k", "--json"], ["resume", "k"],
                 ["resume", "k", "--skip-missed"], ["pause", "k", "twin"],
                 ["resume", "twin", "k", "--skip-missed"], ["pause", "k", "k"],
                 ["resume", "--json", "k", "twin"]):
        s, u = ctl(*sock, *args), ctl(*url, *args)
        assert s.returncode == 0, (args, s.stderr)
        same(s, u)
    ran = ctl(*url, "run", "k")
    assert re.fullmatch(r"queued a run of k now \(as k@run-\S+\)\n", ran.stdout), ran.stdout
    ran = ctl(*url, "run", "k", "--json")
    assert json.loads(ran.stdout)["run_key"].startswith("k@run-")
    assert ctl(*url, "delete", "twin").stdout == "deleted twin\n"
    assert ctl(*url, "delete", "--json", "k").returncode == 0
    assert d.ctl("show", "k", check=False).returncode == 1

    # Refusals: the daemon's line, the socket's exit status.
    d.ctl("add", "here", "t", YEARLY)
    for args in (["add", "here", "t", YEARLY], ["add", "x", "t", "61 * * * *"],
                 ["add", "x", "exec:y", YEARLY], ["add", "x y", "t", YEARLY],
                 ["add", "x", "t", YEARLY, "--misfire", "often"],
                 ["show", "nope"], ["modify", "here"], ["modify", "nope", "--cron", "@daily"],
                 ["modify", "filed", "--cron", "@hourly"], ["delete", "nope"],
                 ["delete", "filed"], ["pause", "nope"], ["pause", "here", "nope", "gone"],
                 ["resume", "nope"], ["run", "nope"], ["history", "nope"], ["next", "nope"],
                 ["logs", "nope"], ["logs", "here"], ["pause"]):
        s, u = ctl(*sock, *args), ctl(*url, *args)
        assert s.returncode == 1, (args, s.stdout, s.stderr)
        same(s, u)
    assert d.ctl_json("show", "here")["paused"] is False  # pause here nope gone: nothing
    # --force over HTTP is ?force=true (admin: root's rights over schedules).
    assert ctl(*url, "modify", "filed", "--cron", "@hourly", "--force").returncode == 0
    assert ctl(*url, "delete", "filed", "--force").stdout == "deleted filed\n"

    # A viewer reads, changes nothing: one line, the exit status of a permission error.
    assert ctl(*viewer, "show", "here").returncode == 0
    for args in (["add", "v", "t", YEARLY], ["pause", "here"], ["modify", "here", "--cron",
                                                                "@daily"],
                 ["delete", "here"], ["run", "here"]):
        one_line(ctl(*viewer, *args), protocol.refusal("PermissionDeniedError").exit_status,
                 "role viewer")
    # Several keys: each is a request, and what was done before a refusal is said.
    assert ctl(*operator, "add", "o1", "ops", YEARLY).returncode == 0
    one_line(ctl(*operator, "pause", "o1", "here"), 1, "only root may schedule it",
             "(paused before it, each by a request of its own: o1)")
    assert [d.ctl_json("show", k)["paused"] for k in ("o1", "here")] == [True, False]
    assert d.stop() == 0


def test_what_cannot_go_over_url_and_bad_credentials(daemon_factory: Any, tmp_path: Path,
                                                     ctl: Ctl) -> None:
    d = start(daemon_factory)
    d.ctl("add", "k", "t", YEARLY)
    base = f"http://127.0.0.1:{d.metrics_port}"
    good = token_file(d, tmp_path, "admin", "admin")
    url = ["--url", base, "--token-file", good]
    (tmp_path / "f.yml").write_text("- {key: f, type: t, cron: '@daily'}\n")
    refused = protocol.refusal("InvalidInputError").exit_status
    for args, says in ((["reload"], "reload does not go over --url"),
                       (["apply", str(tmp_path / "f.yml")], "apply does not go over --url"),
                       (["init"], "perfectschedctl -c CONFIG init"),
                       (["import-crontab", "/dev/null", "--user", "root"], "leave --url out"),
                       (["import-legacy", "sqlite:///x.db"], "import-legacy does not go"),
                       (["pause", "--prefix", "k"], "pause --prefix: not over --url"),
                       (["resume", "--all"], "resume --all: not over --url"),
                       (["history", "--raw", "k"], "--raw"), (["logs", "--raw", "k"], "--raw")):
        one_line(ctl(*url, *args), refused, says)
    assert ctl("--url", base, "--socket", d.socket_path, "list").returncode == 2
    one_line(ctl("--socket", d.socket_path, "--token-file", good, "list"), 1,
             "go with --url")

    # The environment, and the flags before it.
    env = {"PERFECTSCHED_URL": base, "PERFECTSCHED_TOKEN_FILE": good}
    assert ctl("show", "k", env=env).stdout == ctl(*url, "show", "k").stdout
    assert ctl("--socket", d.socket_path, "show", "k", env=env).returncode == 0
    one_line(ctl("--url", base, "list"), 1, "needs an API token", "--token-file")
    one_line(ctl("--url", base, "--token-file", str(tmp_path / "none"), "list"), 1,
             "--token-file: cannot read", "No such file")
    one_line(ctl("--url", base, "list", env={"PERFECTSCHED_TOKEN_FILE": str(tmp_path)}),
             1, "PERFECTSCHED_TOKEN_FILE:", "not a regular file")
    loose = tmp_path / "loose.token"
    shutil.copy(good, loose)
    loose.chmod(0o644)
    one_line(ctl("--url", base, "--token-file", str(loose), "list"), 1,
             "readable by every user", "chmod o-r")
    one_line(ctl("--url", "ftp://127.0.0.1:1", "--token-file", good, "list"), 1,
             "not an https://")
    one_line(ctl("--url", "http://192.0.2.1:9839", "--token-file", good, "list"), 1,
             "--url: refusing to send a token in clear", "--insecure")
    one_line(ctl("list", env={"PERFECTSCHED_URL": "http://192.0.2.1:9839"}), 1,
             "PERFECTSCHED_URL: refusing to send a token in clear")

    # Out of reach: one line naming the URL.
    nowhere = f"http://127.0.0.1:{free_port()}"
    one_line(ctl("--url", nowhere, "--token-file", good, "list"), 1,
             f"cannot reach perfectschedd at {nowhere}: connection refused")
    one_line(ctl("--url", f"https://127.0.0.1:{d.metrics_port}", "--token-file", good,
                 "status"), 1, "cannot reach perfectschedd", "TLS failed")

    # A bad token: one line, the exit status of a caller refused; ten of them: 429.
    bad = tmp_path / "bad.token"
    bad.write_text("pst_1_" + "x" * 43 + "\n")
    bad.chmod(0o600)
    permission = protocol.refusal("PermissionDenied").exit_status
    for _ in range(10):
        one_line(ctl("--url", base, "--token-file", str(bad), "list"), permission,
                 f"{base} refused the token of --token-file {bad}: bad credentials")
    fresh = token_file(d, tmp_path, "never-used", "viewer")
    one_line(ctl("--url", base, "--token-file", fresh, "list"), permission,
             f"{base} refuses this address for now: too many bad credentials")
    # A token this address proved before goes on working (web/credentials.py).
    assert ctl(*url, "list").returncode == 0
    assert d.stop() == 0


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[str, str]:
    """A throw-away certificate for 127.0.0.1, its own CA: (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed (apt-get install openssl)", pytrace=False)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout",
                    str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def test_https_with_a_private_ca(daemon_factory: Any, tmp_path: Path, ctl: Ctl,
                                 certificate: tuple[str, str]) -> None:
    cert, key = certificate
    d = start(daemon_factory, http_tls={"cert": cert, "key": key})
    d.ctl("add", "k", "t", YEARLY)
    base = f"https://127.0.0.1:{d.metrics_port}"
    token = token_file(d, tmp_path, "admin", "admin")
    url = ["--url", base, "--token-file", token, "--ca-file", cert]
    for args in (["list"], ["show", "--json", "k"]):
        same(ctl("--socket", d.socket_path, *args), ctl(*url, *args))
    assert ctl(*url, "pause", "k").stdout == "paused 1 schedule(s): k\n"
    env = {"PERFECTSCHED_URL": base, "PERFECTSCHED_TOKEN_FILE": token,
           "PERFECTSCHED_CA_FILE": cert}
    assert json.loads(ctl("--json", "status", env=env).stdout)["workers_alive"] == 1
    # The system's CAs do not know it; the name must match; no TLS is no answer.
    one_line(ctl("--url", base, "--token-file", token, "list"), 1,
             f"cannot reach perfectschedd at {base}: its certificate is not trusted",
             "--ca-file")
    one_line(ctl("--url", f"https://localhost:{d.metrics_port}", "--token-file", token,
                 "--ca-file", cert, "list"), 1, "not trusted", "mismatch")
    one_line(ctl("--url", f"http://127.0.0.1:{d.metrics_port}", "--token-file", token,
                 "list"), 1, "closed without an answer", "an https:// listener?")
    one_line(ctl(*url[:-1], str(tmp_path / "none.pem"), "list"), 1,
             "--ca-file: cannot read")
    one_line(ctl(*url[:-2], "list", env={"PERFECTSCHED_CA_FILE": token}), 1,
             f"PERFECTSCHED_CA_FILE: cannot use {token}")
    assert d.stop() == 0


# -- without a daemon -----------------------------------------------------------------------


class _Canned(http.server.BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, str, bytes]] = {}
    server_version, sys_version = "perfectschedd/0.9.0", ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status, ctype, body = self.answers[self.path.split("?")[0]]
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def canned() -> Iterator[tuple[str, dict[str, tuple[int, str, bytes]]]]:
    """An HTTP server answering each path as told: (its URL, the answers)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    _Canned.answers = {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Canned.answers
    server.shutdown()
    server.server_close()


def test_503_and_answers_that_are_not_the_api(canned: Any, tmp_path: Path, ctl: Ctl
                                              ) -> None:
    base, answers = canned
    token = tmp_path / "t"
    token.write_text("pst_1_x\n")
    token.chmod(0o600)
    url = ["--url", base, "--token-file", str(token)]
    answers["/api/v1/status"] = (503, "application/json",
                                 b'{"error": "no answer within 8 s (is the database '
                                 b'reachable?)"}\n')
    one_line(ctl(*url, "status"), protocol.refusal("DatabaseUnavailableError").exit_status,
             f"perfectschedd at {base} cannot answer now: no answer within 8 s",
             "try again")
    answers["/api/v1/schedules"] = (502, "text/html", b"<html>Bad Gateway</html>")
    one_line(ctl(*url, "list"), 1, f"{base}: HTTP 502", "not an answer of perfectschedd")
    answers["/api/v1/schedules/k/next"] = (404, "application/json",
                                           b'{"error": "no such path: /api/v1/x"}')
    one_line(ctl(*url, "next", "k"), 1, "no such path", "perfectschedd 0.9.0")
    answers["/api/v1/schedules/k"] = (200, "application/json", b"<not json>")
    one_line(ctl(*url, "show", "k"), 1, "is not JSON")


def test_logs_reads_what_a_page_of_runs_left_out(canned: Any, tmp_path: Path, ctl: Ctl
                                                 ) -> None:
    """logs --attempt N: the newest run that was attempt N among the runs (the route does
    not filter), its output from its output route when the runs' answer left it out; a
    run as a systemd unit has its output in its host's journal, not here."""
    base, answers = canned
    token = tmp_path / "t"
    token.write_text("pst_1_x\n")
    token.chmod(0o600)
    url = ["--url", base, "--token-file", str(token)]

    def run(attempt: int, **fields: Any) -> dict[str, Any]:
        return {"key": "k", "scheduled_time": 1893456000, "attempt": attempt,
                "outcome": "failed", "output": None, "worker": "h1:12", "unit": None,
                **fields}

    runs = [run(2, output="second\n"), run(1, output_omitted=True)]
    answers["/api/v1/schedules/k/runs"] = (200, "application/json",
                                           json.dumps({"items": runs}).encode())
    answers["/api/v1/schedules/k/runs/1893456000/1/output"] = (
        200, "text/plain; charset=utf-8", b"first \x1b[31m\n")
    assert ctl(*url, "logs", "k").stdout == "second\n"
    assert ctl(*url, "logs", "k", "--attempt", "1").stdout == "first \\e[31m\n"
    one_line(ctl(*url, "logs", "k", "--attempt", "3"), 1, "k: no attempt 3 in its history")
    runs[0]["unit"] = "psched-k.service"
    answers["/api/v1/schedules/k/runs"] = (200, "application/json",
                                           json.dumps({"items": runs}).encode())
    one_line(ctl(*url, "logs", "k"), 1, "systemd unit psched-k.service (worker h1:12)",
             "that host's journal")


def test_url_loads_no_heavy_module(daemon_factory: Any, tmp_path: Path) -> None:
    from test_client_imports import heavy, run_client

    d = start(daemon_factory)
    token = token_file(d, tmp_path, "admin", "admin")
    d.ctl("add", "light", "t", YEARLY)
    res, modules = run_client("--url", f"http://127.0.0.1:{d.metrics_port}",
                              "--token-file", token, "list")
    assert res.returncode == 0 and "light" in res.stdout, res.stderr
    assert heavy(modules) == [] and "http.client" in modules
    assert d.stop() == 0


def test_every_error_type_exits_as_over_the_socket() -> None:
    """The type an HTTP status is read back as exits as each type the daemon answers
    with that status."""
    for type_, refusal in protocol.REFUSALS.items():
        back = http_client.STATUS_TYPES[refusal.http_status]
        assert protocol.refusal(back).exit_status == refusal.exit_status, type_
        assert protocol.REFUSALS[back].http_status == refusal.http_status or \
            refusal.http_status in (401, 429), type_


def test_urls_the_client_takes() -> None:
    c = http_client.HttpClient("https://sched.example.com:9839/", "t")
    assert (c.host, c.port, c.tls, c.prefix) == ("sched.example.com", 9839, True, "")
    c = http_client.HttpClient("https://proxy.example.com/perfectsched/", "t")
    assert (c.port, c.prefix) == (None, "/perfectsched")
    http_client.HttpClient("http://[::1]:9839", "t")
    http_client.HttpClient("http://localhost:9839", "t")
    http_client.HttpClient("http://192.0.2.1:9839", "t", insecure=True)
    for bad, says in (("http://192.0.2.1:9839", "in clear"), ("sched:9839", "not an"),
                      ("https://u:p@h:1", "--token-file"), ("https://h:1?x=1", "only"),
                      ("https://h:99999", "bad port"), ("https://", "not an")):
        with pytest.raises(ConfigError, match=says):
            http_client.HttpClient(bad, "t")
    assert http_client.key_path("a/b c") == "schedules/a%2Fb%20c"
    assert http_client.key_path("..", "run") == "schedules/%2E%2E/run"
