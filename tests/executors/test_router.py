"""The router (router.py): a task type to its handler (first route wins, python classes
imported once, broken routes refused), and run_task's own cases."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest
from executor_harness import FakeTask, run, sh

from perfectschedd.executors.application import PythonHandler
from perfectschedd.executors.command import ExecHandler
from perfectschedd.executors.router import HANDLER_CLASSES, Router, run_task
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.outcomes import Outcome

# --------------------------------------------------------------------------- router


def routes(*pairs: tuple[str, str]) -> tuple[RouteConfig, ...]:
    out = []
    for pattern, target in pairs:
        if ":" in target:
            out.append(RouteConfig(pattern=pattern, python=target))
        else:
            out.append(RouteConfig(pattern=pattern, exec=(target,), timeout=5))
    return tuple(out)


def test_router_exact_regexp_first_wins() -> None:
    router = Router(routes(
        ("backup", "/bin/backup"),
        ("/^report-.*$/", "/bin/report"),
        ("/report/", "/bin/other"),
        ("report-x", "/bin/never"),
    ))
    backup = router.match("backup")
    assert isinstance(backup, ExecHandler)
    assert backup.argv == ("/bin/backup",) and backup.timeout == 5
    report = router.match("report-x")
    assert isinstance(report, ExecHandler) and report.argv == ("/bin/report",)
    other = router.match("my-report")
    assert isinstance(other, ExecHandler) and other.argv == ("/bin/other",)
    assert router.match("backup2") is None
    assert router.match("unknown") is None
    assert router.match("backup") is backup


def test_router_imports_python_lazily_once(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "handlers_lazy_jobs.py").write_text(
        "import perfectschedd.executors.application as h\n"
        "IMPORTS = globals().get('IMPORTS', 0) + 1\n"
        "class Report(h.Application):\n"
        "    def run(self):\n"
        "        self.task.finish()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    router = Router(routes(("/^report-/", "handlers_lazy_jobs:Report")))
    assert "handlers_lazy_jobs" not in sys.modules
    a = router.match("report-a")
    b = router.match("report-b")
    assert isinstance(a, PythonHandler) and a is b
    assert a.app_class.__name__ == "Report"
    task = FakeTask()
    assert run_task(task, a).outcome == Outcome.SUCCESS
    monkeypatch.delitem(sys.modules, "handlers_lazy_jobs")


@pytest.mark.parametrize("target", ["no_such_module_xyz:Job", "json:NoSuchClass", "json:dumps"])
def test_router_broken_python_route(target: str, caplog: pytest.LogCaptureFixture) -> None:
    router = Router(routes(("job", target), ("/.*/", "/bin/fallback")))
    assert router.match("job") is None
    assert router.match("job") is None
    broken = [r for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(broken) == 1
    assert broken[0].levelno == logging.ERROR
    assert target in broken[0].getMessage() and "'job'" in broken[0].getMessage()
    assert isinstance(router.match("other"), ExecHandler)


def test_stop_before_start_releases() -> None:
    stop = threading.Event()
    stop.set()
    task = FakeTask()
    assert run(task, sh("exit 0"), stop_event=stop).outcome == Outcome.STOPPED
    assert task.calls == [("release",)]


def test_handlers_say_whether_their_runs_start_processes() -> None:
    """The worker reports a run's processes to the master (Spawning, Ended) by what the
    handler declares: exec and systemd units (a UnitHandler is an ExecHandler) do,
    python applications (the worker's own thread) do not."""
    declared = {name: load().runs_commands for name, load in HANDLER_CLASSES.items()}
    assert declared == {"exec": True, "systemd": True, "python": False}
    assert not PythonHandler.runs_commands

