"""perfectschedctl over the socket loads none of the daemon's heavy libraries: not
SQLAlchemy, dbus-next, croniter (nor dateutil, which croniter brings), YAML or
prometheus_client.  Each would add tens of milliseconds to every start (bench/
client_start.py times it; docs/performance.md).  The commands that need one import it
themselves: `next` croniter, `-c CONFIG` the store and the config, `apply` YAML; `--url`
ssl and http.client (perfectschedctl/http_client.py), which the socket never needs."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

HEAVY = ("sqlalchemy", "dbus_next", "croniter", "dateutil", "yaml", "prometheus_client")
# The package's modules that pull those in: none of them belongs on the client's path.
HEAVY_OWN = ("perfectschedd.config", "perfectschedd.schedules.cron",
             "perfectschedd.schedules.collection", "perfectschedd.store",
             "perfectschedd.metrics", "perfectschedd.control.dbus_server")
# Loaded by --url only (tests/perfectschedctl/test_http_client.py runs it).
URL_ONLY = ("ssl", "http.client", "perfectschedctl.http_client")

# The console script's body (pip's wrapper, Debian's /usr/bin/perfectschedctl), then the
# modules loaded by the time the process exits, printed as one JSON line on stderr.
SCRIPT = """\
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules)), file=sys.stderr))
from perfectschedctl.cli import main
sys.exit(main())
"""


def run_client(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    res = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True,
                         text=True, timeout=60)
    line = next(x for x in res.stderr.splitlines() if x.startswith("MODULES "))
    return res, set(json.loads(line.removeprefix("MODULES ")))


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules
                  if m.split(".")[0] in HEAVY or m.startswith(HEAVY_OWN))


def url_only(modules: set[str]) -> list[str]:
    return sorted(set(URL_ONLY) & modules)


def test_the_checker_sees_a_heavy_module() -> None:
    assert heavy({"yaml.loader", "perfectschedd.store.sql", "json", "perfectschedd.errors"}
                 ) == ["perfectschedd.store.sql", "yaml.loader"]


def test_importing_the_client_loads_no_heavy_module() -> None:
    code = "import json, sys, perfectschedctl.cli; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    modules = set(json.loads(out))
    assert "perfectschedctl.cli" in modules
    assert heavy(modules) == [] and url_only(modules) == []


def test_version_loads_no_heavy_module() -> None:
    res, modules = run_client("--version")
    assert res.returncode == 0 and res.stdout.startswith("perfectschedctl "), res.stderr
    assert heavy(modules) == []


def test_list_and_status_over_the_socket_load_no_heavy_module(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    d.ctl("add", "light-start", "t", "0 0 1 1 *")
    res, modules = run_client("--socket", d.socket_path, "list")
    assert res.returncode == 0, res.stderr
    assert "light-start" in res.stdout
    assert heavy(modules) == [] and url_only(modules) == []
    res, modules = run_client("--socket", d.socket_path, "--json", "status")
    assert res.returncode == 0, res.stderr
    assert "workers" in json.loads(res.stdout)
    assert heavy(modules) == [] and url_only(modules) == []


def test_next_still_loads_croniter_where_it_needs_it() -> None:
    """The lazy import happens: `next --cron` works and is the one that loads it."""
    res, modules = run_client("next", "--cron", "0 12 * * *", "-s", "0", "-n", "2")
    assert res.returncode == 0, res.stderr
    assert "1970-01-01" in res.stdout and "1970-01-02" in res.stdout
    assert "croniter" in modules
