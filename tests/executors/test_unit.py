"""executors/systemd/unit.py and wrap.py without systemd: the transient unit a run asks
for (its D-Bus properties), how a unit's end becomes the run's outcome (and the task the
worker then ends by it), and the wrapper that passes the last stdout line to the worker
while the output goes on to the journal.  Runs under a real systemd are
tests/system/test_units.py's."""

from __future__ import annotations

import logging
import os
import pwd
import signal
import subprocess
import sys
from typing import Any

import pytest
from executor_harness import FakeTask

from perfectschedd.executors.base import RunControl, StopReason
from perfectschedd.executors.systemd import unit
from perfectschedd.executors.systemd.unit import UnitHandler
from perfectschedd.settings import unit_props
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.outcomes import Outcome
from perfectschedd.worker.ending import end_task

LOG = logging.getLogger("test.unit")
NAME = "perfectsched-k-1357000000.service"


def handler(**route: Any) -> UnitHandler:
    r = RouteConfig(pattern="exec:k", exec=("/bin/sh", "-c", "echo hi"), executor="systemd",
                    append_key=False, **route)
    return UnitHandler(r, tuple(r.exec or ()), r.timeout)


def props(task: FakeTask, h: UnitHandler) -> dict[str, tuple[str, Any]]:
    got = unit.properties(task, h, NAME, node="host1", kill_grace=5,
                              tag=unit_props.daemon_tag("/run/perfectsched/perfectschedd.sock"))
    return {name: (v.signature, v.value) for name, v in got}


def test_the_transient_unit_of_a_run() -> None:
    task = FakeTask(key="k", type="exec:k", data={"x": [1]}, attempt=2)
    h = handler(timeout=90, user="nobody", env=(("A", "1"),),
                unit=unit_props.convert({"MemoryMax": "1G", "CPUQuota": "50%"}))
    p = props(task, h)
    assert p["Type"] == ("s", "exec")
    path, argv, ignore = p["ExecStart"][1][0]
    assert p["ExecStart"][0] == "a(sasb)" and path == sys.executable and ignore is False
    assert argv[1:3] == ["-I", unit._WRAPPER] and argv[3:] == ["--", "/bin/sh", "-c",
                                                                     "echo hi"]
    assert p["StandardInput"] == ("s", "data")
    assert p["StandardInputData"] == ("ay", b'{"x": [1]}')
    assert p["StandardOutput"] == ("s", "journal")
    assert p["StandardErrorFileDescriptor"] == ("h", 0)  # the verdict pipe
    assert p["User"] == ("s", "nobody") and p["Group"][0] == "s"
    assert p["RuntimeMaxUSec"] == ("t", 90_000_000)
    assert p["TimeoutStopUSec"] == ("t", 5_000_000)
    assert p["CollectMode"] == ("s", "inactive-or-failed") and p["AddRef"] == ("b", True)
    assert p["MemoryMax"] == ("t", 1 << 30) and p["CPUQuotaPerSecUSec"] == ("t", 500_000)
    env = p["Environment"][1]
    assert {"PERFECTSCHED_KEY=k", "PERFECTSCHED_TYPE=exec:k", "PERFECTSCHED_ATTEMPT=2",
            "PERFECTSCHED_SCHEDULED_TIME=1357000000", f"PERFECTSCHED_UNIT={NAME}",
            "A=1"} <= set(env)
    assert p["Description"][1].endswith(unit.owner_mark("host1", __import__("os")
                                                            .getpid()))
    # Which daemon of this host started it: the clean-ups of another leave it alone.
    tag = unit_props.daemon_tag("/run/perfectsched/perfectschedd.sock")
    assert tag in p["Description"][1] and unit_props.started_by(p["Description"][1], tag)
    assert not unit_props.started_by(p["Description"][1], unit_props.daemon_tag("/tmp/x.sock"))
    assert unit_props.started_by("PerfectSched job k (worker host1:1)", tag)  # 0.1.0's


def test_a_route_s_key_is_the_last_argument_and_no_timeout_no_limit() -> None:
    r = RouteConfig(pattern="backup", exec=("/usr/bin/backup", "--full"), executor="systemd")
    p = props(FakeTask(key="nightly"), UnitHandler(r, tuple(r.exec or ()), None))
    assert p["ExecStart"][1][0][1][-3:] == ["/usr/bin/backup", "--full", "nightly"]
    assert "RuntimeMaxUSec" not in p
    # Without user: the daemon's own user, never systemd's default (root, for a unit
    # started by any caller).
    assert p["User"] == ("s", pwd.getpwuid(os.geteuid()).pw_name)


EXITED, KILLED = 1, 2


@pytest.mark.parametrize("state,last,outcome,call,logged", [
    ({"Result": "success", "ExecMainCode": EXITED, "ExecMainStatus": 0}, "", Outcome.SUCCESS,
     ("finish",), None),
    ({"Result": "exit-code", "ExecMainCode": EXITED, "ExecMainStatus": 3}, "",
     Outcome.FAILED, ("retry", (), {}), None),
    ({"Result": "exit-code", "ExecMainCode": EXITED, "ExecMainStatus": 3}, "SCHED_DONE",
     Outcome.SUCCESS, ("finish",), None),
    ({"Result": "success", "ExecMainCode": EXITED, "ExecMainStatus": 0}, "SCHED_FAIL",
     Outcome.FAILED, ("retry", (), {}), None),
    ({"Result": "success", "ExecMainCode": EXITED, "ExecMainStatus": 0}, "SCHED_LATER 5",
     Outcome.LATER, ("retry", (), {"wait": 5, "later": True}), None),
    ({"Result": "signal", "ExecMainCode": KILLED, "ExecMainStatus": 11}, "",
     Outcome.FAILED, ("retry", (), {}), None),
    ({"Result": "timeout", "ExecMainCode": KILLED, "ExecMainStatus": 15}, "",
     Outcome.TIMEOUT, ("retry", (), {}), "timed out after 2s and was stopped"),
    ({"Result": "oom-kill", "ExecMainCode": KILLED, "ExecMainStatus": 9}, "SCHED_DONE",
     Outcome.FAILED, ("retry", (), {}), "was killed: out of memory (OOM"),
    ({"Result": "exit-code", "ExecMainCode": EXITED, "ExecMainStatus": 217}, "",
     Outcome.FAILED, ("retry", (), {}), None),
    ({"Result": "start-limit-hit"}, "", Outcome.FAILED, ("retry", (), {}),
     "failed: result start-limit-hit"),
])
def test_how_a_unit_s_end_ends_the_task(state: dict[str, Any], last: str, outcome: Outcome,
                                        call: tuple[Any, ...], logged: str | None,
                                        caplog: pytest.LogCaptureFixture) -> None:
    task = FakeTask(key="k")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        got = unit.unit_result(task.key, NAME, state, last, None, None, 2, LOG)
    end_task(task, got)
    assert got.outcome is outcome and task.calls == [call]
    if logged is not None:
        assert any(logged in r.getMessage() and NAME in r.getMessage()
                   for r in caplog.records), caplog.text


def test_a_stopped_unit_is_given_back_on_shutdown_and_written_nowhere_when_preempted(
        ) -> None:
    state = {"Result": "success", "ExecMainCode": KILLED, "ExecMainStatus": 15}
    for reason, outcome, calls in ((StopReason.SHUTDOWN, Outcome.STOPPED, [("release",)]),
                                   (StopReason.PREEMPTED, Outcome.PREEMPTED, []),
                                   (StopReason.FENCED, Outcome.PREEMPTED, [])):
        control = RunControl()
        control.stop(reason)
        task = FakeTask(key="k")
        result = unit.unit_result(task.key, NAME, state, "SCHED_DONE", "stop", control, None,
                                  LOG)
        assert result.outcome is outcome
        end_task(task, result)
        assert task.calls == calls
    assert unit.exit_code(state) == -15
    assert unit.exit_code({"ExecMainCode": EXITED, "ExecMainStatus": 4}) == 4
    assert unit.exit_code({"Result": "resources"}) is None


# -- the wrapper --------------------------------------------------------------------------


def wrap(*argv: str, data: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """wrap.py as systemd starts it: stdout (the journal here) and stderr (the worker's
    verdict pipe) kept apart."""
    return subprocess.run([sys.executable, "-I", unit._WRAPPER, "--", *argv],
                          input=data, capture_output=True, timeout=30)


def test_the_wrapper_passes_output_on_and_the_last_line_to_the_worker() -> None:
    r = wrap("/bin/sh", "-c", 'cat; echo; echo "to stderr" >&2; echo SCHED_LATER 5; echo; '
                              "exit 3", data=b'{"k": 1}')
    assert r.returncode == 3
    # The command's stderr reaches the journal directly, its stdout through the wrapper:
    # their order there is not fixed.
    out = r.stdout.decode()
    assert out.replace("to stderr\n", "") == '{"k": 1}\nSCHED_LATER 5\n\n'
    assert "to stderr\n" in out
    assert r.stderr == b"SCHED_LATER 5\n"


def test_the_wrapper_dies_as_the_command_did() -> None:
    r = wrap("/bin/sh", "-c", "echo partial line without newline; kill -TERM $$")
    assert r.returncode == -signal.SIGTERM
    assert r.stdout == b"partial line without newline\n"
    assert r.stderr == b"partial line without newline\n"
    assert wrap("/bin/sh", "-c", "kill -KILL $$").returncode == -signal.SIGKILL


def test_the_wrapper_says_why_a_command_does_not_start() -> None:
    r = wrap("/no/such/program")
    assert r.returncode == 127 and b"cannot run /no/such/program" in r.stdout
    assert r.stderr == b""


def test_a_unit_knows_its_schedule_and_env_cannot_replace_the_run_s_variables() -> None:
    """An extra run's unit: PERFECTSCHED_KEY is its own key, PERFECTSCHED_SCHEDULE_KEY the
    schedule's; the route's env: comes first, so systemd's last-wins keeps ours."""
    task = FakeTask(key="k@run-1357000000-ab12cd34", type="exec:k")
    env = props(task, handler(user="nobody", env=(("PERFECTSCHED_KEY", "forged"),
                                                  ("B", "2"))))["Environment"][1]
    assert env[:2] == ["PERFECTSCHED_KEY=forged", "B=2"]
    assert env[2:4] == ["PERFECTSCHED_KEY=k@run-1357000000-ab12cd34",
                        "PERFECTSCHED_SCHEDULE_KEY=k"]
