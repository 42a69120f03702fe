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


# The master forks a worker while its notification thread is inside start_helper (the
# helper's own fork, under the registry's lock).  The worker's notification thread then
# starts helpers of its own (a hook, sendmail): the lock it inherited must not be held
# for good by a thread that does not exist in it.
FORK_DURING_START = textwrap.dedent("""
    import json, os, signal, subprocess, threading
    from perfectschedd.executors import reaper

    inside, go_on = threading.Event(), threading.Event()

    def slow_start():
        inside.set()
        go_on.wait(30)
        return subprocess.Popen(["sleep", "30"])

    started = []
    notifier = threading.Thread(target=lambda: started.append(reaper.start_helper(slow_start)))
    notifier.start()
    inside.wait(30)
    pid = os.fork()
    if pid == 0:  # the worker
        signal.alarm(10)
        proc = reaper.start_helper(lambda: subprocess.Popen(["true"]))
        proc.wait()
        reaper.end_helper(proc.pid)
        os._exit(0 if reaper.strays(os.getpid(), lambda p: False) == [] else 3)
    go_on.set()
    notifier.join()
    _, status = os.waitpid(pid, 0)
    started[0].kill()
    started[0].wait()
    reaper.end_helper(started[0].pid)
    print(json.dumps({"worker_exit": os.waitstatus_to_exitcode(status)}))
""")


def test_a_worker_forked_while_the_master_starts_a_helper_can_start_its_own() -> None:
    out = subprocess.run([sys.executable, "-c", FORK_DURING_START], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    # -14 (SIGALRM): the worker waited for the registry's lock that no thread of it held.
    assert json.loads(out.strip().splitlines()[-1]) == {"worker_exit": 0}
