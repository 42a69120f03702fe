"""Secrets from files against a real daemon (issue 38): a daemon on a real PostgreSQL
whose URL holds no password (password_file:, and as a systemd credential), a reload that
reads a changed file and reconnects with it, perfectschedctl -c reading it too, a bad
file refused in one line while the daemon runs on, and a webhook's bearer token from a
file reaching a real receiver."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, sh, wait_until
from dbservers import PostgresServer
from notify_receivers import Receiver


def secret_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def ran(d: Daemon, key: str) -> list[dict[str, Any]]:
    return [r for r in d.ctl_json("history", key, "-n", "100") if r["outcome"] == "success"]


@pytest.fixture
def pg_role(postgres_server: PostgresServer) -> Any:
    """A database owned by a role of this test's own (its password changes here; the
    shared server's `sched` stays as it is): (url without a password, role)."""
    role = f"sec_{uuid.uuid4().hex[:10]}"
    postgres_server.psql(f"CREATE ROLE {role} LOGIN PASSWORD 'first%41pw'")
    postgres_server.psql(f"CREATE DATABASE {role} OWNER {role}")
    yield f"postgresql://{role}@127.0.0.1:{postgres_server.port}/{role}", role
    postgres_server.drop_database(role)
    postgres_server.psql(f"DROP ROLE IF EXISTS {role}")


def test_a_daemon_on_postgresql_takes_its_password_from_a_file_and_reload_rereads_it(
        daemon_factory: Any, postgres_server: PostgresServer, pg_role: Any,
        tmp_path: Path) -> None:
    url, role = pg_role
    password = secret_file(tmp_path / "dbpass", "first%41pw\n")
    d: Daemon = daemon_factory({"password_file": str(password), "workers": 1,
                                "routes": [sh("t", "echo ran")]}, url=url).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: len(ran(d, "k")) == 1, 20, what="a run recorded by the worker")
    # perfectschedctl -c opens the database itself with the same file
    direct = subprocess.run([sys.executable, "-m", "perfectschedctl", "-c",
                             str(d.config_path), "list", "--json"],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("PERFECTSCHED_")})
    assert direct.returncode == 0 and '"k"' in direct.stdout, direct.stderr
    assert "first%41pw" not in d.log()

    # The password changes on the server and in the file; the old sessions are cut.
    postgres_server.psql(f"ALTER ROLE {role} PASSWORD 'second'")
    secret_file(password, "second\n")
    d.ctl("reload")
    postgres_server.psql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         f"WHERE usename = '{role}' AND pid <> pg_backend_pid()")
    d.ctl("run", "k")
    wait_until(lambda: len(ran(d, "k")) == 2, 30,
               what="a run after the reload, on connections made with the new password")
    assert d.alive()

    # A file that everyone may read is refused: one line, the running configuration
    # (and its password) stays.
    password.chmod(0o644)
    res = d.ctl("reload", check=False)
    assert res.returncode == 1, res
    (line,) = res.stderr.strip().splitlines()
    assert "password_file: " in line and "is readable by every user (mode 0644)" in line
    assert "second" not in line
    d.ctl("run", "k")
    wait_until(lambda: len(ran(d, "k")) == 3, 30, what="a run after the refused reload")
    assert d.alive()


def test_a_systemd_credential_gives_the_password(
        daemon_factory: Any, postgres_server: PostgresServer, tmp_path: Path) -> None:
    """password_file: NAME is $CREDENTIALS_DIRECTORY/NAME (LoadCredential=NAME:PATH)."""
    creds = tmp_path / "credentials"
    creds.mkdir(mode=0o700)
    secret_file(creds / "dbpass", "sched", mode=0o400)  # the shared server's password
    url = postgres_server.create_database(f"cred_{uuid.uuid4().hex[:10]}")
    bare = url.replace(":sched@", "@")
    assert bare != url
    d: Daemon = daemon_factory({"password_file": "dbpass", "workers": 1,
                                "routes": [sh("t", "echo ran")]}, url=bare,
                               env={"CREDENTIALS_DIRECTORY": str(creds)}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: len(ran(d, "k")) == 1, 20, what="a run recorded by the worker")


def test_a_webhook_token_from_a_file_reaches_the_receiver(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    hook = Receiver()
    try:
        token = secret_file(tmp_path / "token", "tok-first\n")
        d: Daemon = daemon_factory({
            "workers": 1, "retry_wait": 1, "retry_wait_max": 1,
            "notifiers": {"hook": {"webhook": hook.url, "token_file": str(token),
                                   "when": "every-failure"}},
            "routes": [sh("t", "exit 3")]}).start()
        d.ctl("add", "k", "t", YEARLY, "--at", "0", "--notify", "hook")
        wait_until(lambda: len(hook.docs) >= 1, 20, what="the first failure told")
        secret_file(token, "tok-second\n")  # read at each sending: no reload
        wait_until(lambda: "Bearer tok-second" in hook.authorizations, 20,
                   what="a failure told with the new token")
        assert hook.authorizations[0] == "Bearer tok-first"
        assert set(hook.authorizations) <= {"Bearer tok-first", "Bearer tok-second"}
        assert "tok-" not in d.log()
        # A token file the daemon cannot use is refused on reload, in one line.
        token.unlink()
        res = d.ctl("reload", check=False)
        assert res.returncode == 1, res
        (line,) = res.stderr.strip().splitlines()
        assert "notifier hook: token_file: cannot read" in line and "No such file" in line
        assert d.alive()
    finally:
        hook.close()


def test_a_notifier_s_missing_token_file_stops_the_start(daemon_factory: Any,
                                                         tmp_path: Path) -> None:
    d: Daemon = daemon_factory({
        "notifiers": {"hook": {"webhook": "http://127.0.0.1:9/",
                               "token_file": str(tmp_path / "none")}},
        "routes": [sh("t", "true")]}).start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(20) == 1
    said = [line for line in d.log().splitlines() if "token_file:" in line]
    assert len(said) == 1 and "notifier hook: token_file: cannot read" in said[0]
