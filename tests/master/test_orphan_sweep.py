"""The master's sweep for what ended runs left behind (cleanup.RunCleanup.sweep_orphans)
kills its non-worker children, but never a child it started itself: a notification's
hook or sendmail (notify/senders.py) runs as the master's child for up to its timeout.

The "master" is a process of its own here: a sweep in the test process would kill the
test's own children (its database servers)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

MASTER = textwrap.dedent("""
    import json, os, subprocess, time
    from perfectschedd.executors import reaper
    from perfectschedd.master.cleanup import RunCleanup
    from perfectschedd.master.workertable import WorkerTable

    helper = reaper.start_helper(lambda: subprocess.Popen(["sleep", "30"]))
    stray = subprocess.Popen(["sleep", "30"])
    cleanup = RunCleanup.__new__(RunCleanup)  # the sweep needs no unit stopper
    cleanup.next_sweep = 0.0
    cleanup.sweep_orphans(WorkerTable(2, 5.0), os.getpid(), lambda pid: None)
    stray.wait(10)
    alive = helper.poll() is None
    helper.kill()
    helper.wait()
    reaper.end_helper(helper.pid)
    print(json.dumps({"helper_alive": alive, "stray_signal": -stray.returncode}))
""")


def test_the_sweep_kills_strays_and_spares_the_masters_own_helpers() -> None:
    out = subprocess.run([sys.executable, "-c", MASTER], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"helper_alive": True, "stray_signal": 9}
