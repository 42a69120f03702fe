"""The python executor (application.py): an Application in the calling thread, how its
finish/retry/release and exceptions become the run's outcome (and the task the worker
then ends by it), timeouts and stops by the watchdog, kill()."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from executor_harness import LOGGER, FakeTask, py, run

from perfectschedd.errors import AlreadyFinishedError
from perfectschedd.executors import base
from perfectschedd.executors.application import Application, HandlerTimeout
from perfectschedd.executors.router import run_task
from perfectschedd.vocabulary.outcomes import Outcome

# --------------------------------------------------------------------------- python


class Finishes(Application):
    def run(self) -> None:
        self.task.finish()


class ReturnsQuietly(Application):
    def run(self) -> None:
        pass


class RetriesLater(Application):
    def run(self) -> None:
        self.task.retry(wait=12)


class Retries(Application):
    def run(self) -> None:
        self.task.retry()


class Releases(Application):
    def run(self) -> None:
        self.task.release()


class Raises(Application):
    def run(self) -> None:
        raise ValueError("boom")


class Spins(Application):
    def run(self) -> None:
        while True:
            time.sleep(0.01)


class SpinsCatchingException(Application):
    def run(self) -> None:
        while True:
            try:
                time.sleep(0.01)
            except Exception:  # must not swallow HandlerTimeout
                pass


class FinishesSlowly(Application):
    def run(self) -> None:
        self.task.finish()
        while True:
            time.sleep(0.01)


@pytest.mark.parametrize("cls,outcome,calls", [
    (Finishes, Outcome.SUCCESS, [("finish",)]),
    (ReturnsQuietly, Outcome.SUCCESS, [("finish",)]),
    (Retries, Outcome.FAILED, [("retry", (), {})]),
    # SCHED_LATER's equivalent: not a failure (issue 39 item 3).
    (RetriesLater, Outcome.LATER, [("retry", (), {"wait": 12, "later": True})]),
    (Releases, Outcome.RELEASED, [("release",)]),
])
@pytest.mark.parametrize("armed", [False, True])
def test_python_outcomes(cls: type, outcome: Outcome, calls: list[Any], armed: bool) -> None:
    task = FakeTask()
    kw: dict[str, Any] = {"stop_event": threading.Event()} if armed else {}
    result = run(task, py(cls, timeout=10 if armed else None), **kw)
    assert result.outcome == outcome
    assert result.exit_code is None
    assert task.calls == calls


def test_python_exception_retries_with_traceback(caplog: pytest.LogCaptureFixture) -> None:
    task = FakeTask(key="k-raise")
    assert run(task, py(Raises)).outcome == Outcome.FAILED
    assert task.calls == [("retry", (), {})]
    record = next(r for r in caplog.records if r.getMessage().startswith("k-raise:"))
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and "boom" in caplog.text


def test_python_preempted() -> None:
    assert run(FakeTask(preempted=True), py(Finishes)).outcome == Outcome.PREEMPTED
    assert run(FakeTask(preempted=True), py(ReturnsQuietly)).outcome == Outcome.PREEMPTED


@pytest.mark.parametrize("cls", [Spins, SpinsCatchingException])
def test_python_timeout_retries_and_thread_goes_on(cls: type,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    out: list[Any] = []

    def worker() -> None:
        first = FakeTask(key="spin")
        out.append((run(first, py(cls, timeout=0.2)), first.calls))
        time.sleep(0.3)  # no stray exception arrives later
        second = FakeTask()
        out.append((run(second, py(Finishes, timeout=5)), second.calls))

    t = threading.Thread(target=worker)
    t.start()
    t.join(5)
    assert not t.is_alive()
    (first, first_calls), (second, second_calls) = out
    assert first.outcome == Outcome.TIMEOUT
    assert 0.2 <= first.duration < 1.0
    assert first_calls == [("retry", (), {})]
    assert second.outcome == Outcome.SUCCESS and second_calls == [("finish",)]
    assert "spin: " in caplog.text and "timed out after 0.2s" in caplog.text


def test_python_timeout_after_finish_keeps_success() -> None:
    task = FakeTask()
    result = run(task, py(FinishesSlowly, timeout=0.1))
    assert result.outcome == Outcome.SUCCESS
    assert task.calls == [("finish",)]


def test_python_stop_releases() -> None:
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    task = FakeTask()
    result = run(task, py(Spins), stop_event=stop)
    assert result.outcome == Outcome.STOPPED
    assert task.calls == [("release",)]
    assert result.duration < 1.0


def test_handler_timeout_is_not_an_exception() -> None:
    assert not issubclass(HandlerTimeout, Exception)


def test_python_overhead_is_microseconds() -> None:
    handler = py(ReturnsQuietly, timeout=60)
    stop = threading.Event()
    log = logging.getLogger(LOGGER)
    for kw in ({}, {"stop_event": stop}):
        plain = py(ReturnsQuietly)
        for h in (plain, handler):
            n = 2000
            start = time.perf_counter()
            for _ in range(n):
                run_task(FakeTask(), h, log=log, **kw)
            per_task = (time.perf_counter() - start) / n
            assert per_task < 100e-6, (h, kw, per_task)


class KillRecorder(Application):
    killed: list[str] = []

    def run(self) -> None:
        while True:
            time.sleep(0.01)

    def kill(self) -> None:
        KillRecorder.killed.append(self.task.key)


@pytest.mark.parametrize("how", ["timeout", "stop", "preempted"])
def test_python_kill_is_called_when_the_run_is_stopped(how: str) -> None:
    KillRecorder.killed = []
    control = base.RunControl()
    if how == "stop":
        threading.Timer(0.2, control.stop, args=(base.StopReason.SHUTDOWN,)).start()
    elif how == "preempted":
        threading.Timer(0.2, control.stop, args=(base.StopReason.PREEMPTED,)).start()
    task = FakeTask(key=f"k-{how}")
    result = run(task, py(KillRecorder, timeout=0.2 if how == "timeout" else None),
                 stop_event=control)
    expected = {"timeout": Outcome.TIMEOUT, "stop": Outcome.STOPPED,
                "preempted": Outcome.PREEMPTED}[how]
    assert result.outcome == expected
    wait = time.monotonic() + 2
    while not KillRecorder.killed and time.monotonic() < wait:
        time.sleep(0.01)
    assert KillRecorder.killed == [f"k-{how}"]
    assert task.calls == {"timeout": [("retry", (), {})], "stop": [("release",)],
                          "preempted": []}[how]


class EndsTwice(Application):
    ended: list[str] = []

    def run(self) -> None:
        self.task.finish()
        try:
            self.task.retry()
        except AlreadyFinishedError:
            EndsTwice.ended.append("refused")
            raise


def test_an_application_ends_its_task_once_and_the_worker_writes_it_after_run() -> None:
    """finish() only records the end (nothing is written while run() runs: no timeout can
    cut a write in half); a second end raises AlreadyFinishedError, as the task would."""
    EndsTwice.ended = []
    task = FakeTask()
    result = run_task(task, py(EndsTwice), log=logging.getLogger(LOGGER))
    assert task.calls == [] and EndsTwice.ended == ["refused"]
    assert result.outcome == Outcome.SUCCESS  # the first end stands
    task = FakeTask()
    assert run(task, py(EndsTwice)).outcome == Outcome.SUCCESS
    assert task.calls == [("finish",)]


class GivesBackItself(Application):
    def run(self) -> None:
        self.task.give_back()  # the task's own method, past what the executor sees


def test_a_task_the_application_ended_itself_is_not_ended_again() -> None:
    task = FakeTask()
    result = run(task, py(GivesBackItself))
    assert result.outcome == Outcome.SUCCESS and result.already_ended
    assert task.calls == [("release",)]

