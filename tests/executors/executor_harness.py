"""What the executors' tests share: a task that records how it was ended, handlers of a
shell script or an Application class, and a run as the worker makes it (the executor,
then the worker's one place that ends the task)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from perfectschedd.errors import PreemptedError
from perfectschedd.executors.application import PythonHandler
from perfectschedd.executors.base import Handler, RunResult
from perfectschedd.executors.command import ExecHandler
from perfectschedd.executors.router import run_task
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.worker.ending import run_and_end

LOGGER = "test.executors"


class FakeTask:
    """Stands in for schedules.Task: records how the worker ended it (run)."""

    def __init__(self, key: str = "job-1", type: str = "t", data: dict[str, Any] | None = None,
                 scheduled_time: int = 1357000000, attempt: int = 1,
                 preempted: bool = False) -> None:
        self.key = key
        self.type = type
        self.data = {} if data is None else data
        self.scheduled_time = scheduled_time
        self.attempt = attempt
        self.preempted = preempted
        self.calls: list[tuple[Any, ...]] = []

    @property
    def done(self) -> bool:
        return bool(self.calls)

    def _end(self, *call: Any) -> None:
        if self.preempted:
            raise PreemptedError(self.key)
        assert not self.calls, f"task ended twice: {self.calls} then {call}"
        self.calls.append(call)

    def finish(self) -> None:
        self._end("finish")

    def retry(self, *args: Any, **kwargs: Any) -> None:
        self._end("retry", args, kwargs)

    def release(self) -> None:
        self._end("release")

    def give_back(self) -> None:  # the daemon's release (stop): recorded alike
        self._end("release")


def sh(script: str, timeout: float | None = None) -> ExecHandler:
    """An exec handler running a shell script; the key arrives as $1."""
    argv = ("/bin/sh", "-c", script, "sh")
    return ExecHandler(RouteConfig(pattern="t", exec=argv, timeout=timeout), argv, timeout)


def py(cls: type, timeout: float | None = None) -> PythonHandler:
    route = RouteConfig(pattern="t", python=f"{cls.__module__}:{cls.__name__}",
                        timeout=timeout)
    return PythonHandler(route, cls, timeout)


def run(task: FakeTask, handler: Handler, **kw: Any) -> RunResult:
    """Run `task` as the worker does: the executor (run_task) returns, then the worker's
    one place ends the task by the result (ending.run_and_end); `task.calls` shows what
    was written."""
    kw.setdefault("log", logging.getLogger(LOGGER))
    kw.setdefault("kill_grace", 1.0)
    return run_and_end(task, lambda: run_task(task, handler, **kw), kw["log"])


def gone(pid: int, within: float = 3.0) -> bool:
    """True once pid no longer runs (dead, or a zombie waiting for its reaper)."""
    end = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]
