"""Notifications against a real daemon (issue #27): a schedule failing five times then
recovering is told twice by default and 5 + 1 times with every-failure; a webhook that
hangs or fails delays no run; mail through a sendmail stand-in and an exec notifier;
refusals of unknown names and of mail without sendmail, at start and on reload; a
member's flood of failures does not delay root's (issue 38)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, sh, shared_dir, wait_until
from notify_receivers import Receiver, mails, sendmail_stand_in
from scrape import scrape, value

from perfectschedd import config
from perfectschedd.schedules.collection import ScheduleCollection

# A job that fails its first five runs, then succeeds: a counter in a file.
FLAKY = ('n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; '
         'echo "try $n"; [ $n -gt 5 ]')


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(reversed(d.ctl_json("history", key, "-n", "100")))


@pytest.mark.parametrize(("when", "want"), [
    ("change", [("failure", "failed"), ("recovery", "success")]),
    ("every-failure", [("failure", "failed")] * 5 + [("recovery", "success")]),
])
def test_five_failures_then_a_recovery_are_told(daemon_factory: Any, tmp_path: Path,
                                                when: str, want: list[Any]) -> None:
    hook = Receiver()
    try:
        d: Daemon = daemon_factory({
            "workers": 1,  # one worker: the test needs no second one's history
            "notifiers": {"hook": {"webhook": hook.url, "when": when}},
            "routes": [sh("t", FLAKY.format(c=tmp_path / "count"))]}).start()
        d.ctl("add", "k", "t", YEARLY, "-a", "0", "--retry-wait", "0", "--notify", "hook")
        assert d.ctl_json("show", "k")["notify"] == "hook"
        wait_until(lambda: [r["outcome"] for r in history(d, "k")][-1:] == ["success"], 20,
                   what="the sixth attempt to succeed")
        wait_until(lambda: ("recovery", "success") in hook.events(), 10,
                   what="the notifications")
        time.sleep(1.0)  # nothing more comes
        told = hook.events()
        if when == "every-failure":
            # A failure that came while the one before still waited to be sent takes its
            # place (dispatch.py: one pending run per key) and says so: all six runs are
            # accounted for, the recovery last.
            assert set(told[:-1]) == {("failure", "failed")} and told[-1] == want[-1], told
            assert sum(1 + doc["coalesced"] for doc in hook.docs) == 6, hook.docs
        else:
            assert told == want
        assert [doc["key"] for doc in hook.docs] == ["k"] * len(told)
        assert [doc["attempt"] for doc in hook.docs][-1] == 6
        _, samples = scrape(d.metrics_port)
        assert value(samples, "perfectsched_notifications_total", kind="webhook",
                     result="sent") == len(told)
    finally:
        hook.close()


@pytest.mark.parametrize("mode", ["hang", "500"])
def test_a_receiver_that_hangs_or_fails_delays_no_run(daemon_factory: Any, tmp_path: Path,
                                                      mode: str) -> None:
    hook = Receiver(mode)
    try:
        d: Daemon = daemon_factory({
            "retry_wait": 1, "retry_wait_max": 1,  # an attempt every second
            "notifiers": {"hook": {"webhook": hook.url, "when": "every-failure"}},
            "notify": "hook",
            "routes": [sh("t", "exit 1"), sh("ok", "true")]}).start()
        d.ctl("add", "k", "t", YEARLY, "-a", "0")
        wait_until(lambda: len(history(d, "k")) >= 5, 15, what="five attempts")
        runs = history(d, "k")[:5]
        # Each attempt starts about retry_wait after the one before ended, however long
        # the receiver takes (a hung one holds its notification for 10 s per try).
        gaps = [b["started_at"] - a["finished_at"] for a, b in zip(runs, runs[1:], strict=False)]
        assert all(g < 2.5 for g in gaps), gaps
        started = time.time()
        d.ctl("add", "other", "ok", YEARLY, "-a", "0")
        wait_until(lambda: history(d, "other"), 5, what="another job to run")
        assert history(d, "other")[0]["started_at"] - started < 2.0
        assert hook.requests  # the receiver was asked
        if mode == "500":
            wait_until(lambda: value(scrape(d.metrics_port)[1],
                                     "perfectsched_notifications_total", kind="webhook",
                                     result="failed"), 15, what="a failed notification")
            # The metric is counted before the line is logged (and written by the
            # worker's log writer thread).
            d.wait_log("notification not sent (webhook hook): webhook: HTTP 500")
    finally:
        hook.close()


def test_mail_and_exec_notifiers(daemon_factory: Any, tmp_path: Path) -> None:
    # A root daemon runs notifiers as notify_user (nobody): a directory it may write to.
    shared = shared_dir()
    sendmail, mailbox = sendmail_stand_in(shared)
    told = shared / "told"
    d: Daemon = daemon_factory({
        "sendmail": str(sendmail),
        "notifiers": {
            "ops": {"mail": "ops@example.com"},
            "script": {"exec": ["/bin/sh", "-c",
                                f'{{ echo "$PERFECTSCHED_KEY $PERFECTSCHED_EVENT '
                                f'$PERFECTSCHED_OUTCOME $PERFECTSCHED_EXIT_CODE"; cat; }} '
                                f'>> {told}']}},
        "routes": [sh("mailed", "echo boom; exit 3", notify="ops"),
                   sh("scripted", "echo bang; exit 2")]}).start()
    d.ctl("add", "m", "mailed", YEARLY, "-a", "0", "--max-attempts", "1")
    d.ctl("add", "x", "scripted", YEARLY, "-a", "0", "--max-attempts", "1",
          "--notify", "script")
    wait_until(lambda: mails(mailbox), 15, what="a mail")
    (mail,) = mails(mailbox)
    assert mail.startswith("ARGS: -t -oi\n") and "To: ops@example.com" in mail
    assert "Subject: [perfectsched] m FAILED: failed" in mail
    wait_until(lambda: told.exists() and told.read_text(), 15, what="the exec notifier")
    assert told.read_text().splitlines()[0].startswith("x failure failed")


def test_unknown_names_are_refused(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory({"notifiers": {"ops": {"webhook": "http://127.0.0.1:9/"}},
                                "routes": [sh("t", "true")]}).start()
    res = d.ctl("add", "k", "t", YEARLY, "--notify", "nobody", check=False)
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert line.endswith("notify: no notifier named 'nobody' in this host's notifiers: (ops)")
    assert d.ctl("list", "--json").stdout.strip() == "[]"  # nothing stored
    d.ctl("add", "k", "t", YEARLY, "--notify", "ops")
    res = d.ctl("modify", "k", "--notify", "ghost", check=False)
    assert res.returncode == 1 and "no notifier named 'ghost'" in res.stderr
    assert d.ctl_json("show", "k")["notify"] == "ops"
    d.ctl("modify", "k", "--notify", "none")
    assert d.ctl_json("show", "k")["notify"] is None


def test_mail_without_sendmail_is_refused_at_start_and_on_reload(daemon_factory: Any,
                                                                 tmp_path: Path) -> None:
    mail = {"notifiers": {"ops": {"mail": "ops@example.com"}},
            "sendmail": str(tmp_path / "no-sendmail")}
    d: Daemon = daemon_factory(mail).start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(20) == 1
    refusals = [line for line in d.log().splitlines() if "sendmail:" in line]
    assert len(refusals) == 1 and "no-sendmail is not an executable program" in refusals[0]
    good: Daemon = daemon_factory({"routes": [sh("t", "true")]}).start()
    good.write_config({**good.config, **mail})
    res = good.ctl("reload", check=False)
    assert res.returncode == 1 and "no-sendmail is not an executable program" in res.stderr
    assert good.alive()


def test_a_worker_killed_mid_run_is_told_by_the_master(daemon_factory: Any,
                                                         tmp_path: Path) -> None:
    """A run lost with its worker (kill -9) is recorded by the master, not by a worker:
    the master tells it, with the schedule's own notifier."""
    import os
    import signal

    hook = Receiver()
    try:
        d: Daemon = daemon_factory({
            "workers": 1, "alive_time": 4,
            "notifiers": {"hook": {"webhook": hook.url}},
            "routes": [sh("t", f"touch {tmp_path}/started; sleep 30")]}).start()
        d.ctl("add", "k", "t", YEARLY, "-a", "0", "--notify", "hook")
        wait_until(lambda: (tmp_path / "started").exists(), 10, what="the run to start")
        (victim,) = d.children()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: hook.events(), 15, what="the lost run's notification")
        assert hook.events()[0] == ("failure", "lost")
        assert hook.docs[0]["key"] == "k"
        assert "died" in (hook.docs[0].get("error") or ""), hook.docs[0]
    finally:
        hook.close()


def test_a_schedules_file_that_mails_without_sendmail_is_rejected_whole(
        daemon_factory: Any, tmp_path: Path) -> None:
    """An entry's inline mail notifier on a host without sendmail: its file is rejected
    (one line naming the entry), the other files' schedules are made."""
    import yaml

    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    (sdir / "mails.yml").write_text(yaml.safe_dump(
        [{"key": "mailed", "cron": "@daily", "type": "t",
          "notify": {"mail": "ops@example.com"}},
         {"key": "beside", "cron": "@daily", "type": "t"}]))
    (sdir / "plain.yml").write_text(yaml.safe_dump(
        [{"key": "plain", "cron": "@daily", "type": "t"}]))
    d: Daemon = daemon_factory({"schedules_dir": str(sdir),
                                "sendmail": str(tmp_path / "no-sendmail"),
                                "routes": [sh("t", "true")]}).start()
    wait_until(lambda: [s["key"] for s in d.ctl_json("list")] == ["plain"], 10,
               what="the other file's schedule")
    wait_until(lambda: "entry mailed: notify: mail needs sendmail" in d.log(), 5,
               what="the rejection")
    time.sleep(0.5)
    assert [s["key"] for s in d.ctl_json("list")] == ["plain"]


def test_an_entrys_own_notifier_tells_its_extra_and_split_off_runs(daemon_factory: Any,
                                                                   tmp_path: Path) -> None:
    """A schedules file entry's inline notifier is its schedule's: it, not the host's
    default, tells the failures of the schedule's extra run (`run KEY`) and of the
    occurrences an allow schedule runs on rows of their own (both keyed KEY@run-...)."""
    import yaml

    mine, default = Receiver(), Receiver()
    try:
        sdir = tmp_path / "schedules.d"
        sdir.mkdir()
        own = {"webhook": mine.url, "when": "every-failure"}
        (sdir / "jobs.yml").write_text(yaml.safe_dump([
            {"key": "manual", "cron": YEARLY, "type": "t", "max_attempts": 1,
             "notify": dict(own)},
            {"key": "often", "cron": "@every 1s", "type": "t", "max_attempts": 1,
             "concurrency": "allow", "notify": dict(own)}]))  # no YAML alias
        d: Daemon = daemon_factory({
            "schedules_dir": str(sdir),
            "notifiers": {"host": {"webhook": default.url, "when": "every-failure"}},
            "notify": "host", "routes": [sh("t", "exit 1")]}).start()
        wait_until(lambda: len(d.ctl_json("list")) == 2, 10, what="the file's schedules")
        d.ctl("run", "manual")

        def told(base: str) -> bool:
            return any(doc["key"].startswith(f"{base}@run-") for doc in mine.docs)

        wait_until(lambda: told("manual") and told("often"), 20,
                   what="the entry's notifier told of both runs' failures")
        assert {doc["key"].split("@run-")[0] for doc in default.docs} == set()
    finally:
        mine.close()
        default.close()


def test_an_allow_schedule_failing_then_recovering_is_told_twice(daemon_factory: Any,
                                                                  tmp_path: Path) -> None:
    """`when: change` of a schedule whose occurrences run on rows of their own (allow:
    KEY@run-...): its first failure and its recovery, as for any schedule; not each
    occurrence's failure, and not no recovery at all."""
    hook = Receiver()
    ok = tmp_path / "ok"
    try:
        d: Daemon = daemon_factory({
            # One worker, one thread: the occurrences end in their order.
            "workers": 1, "concurrency": 1,
            "notifiers": {"hook": {"webhook": hook.url}}, "notify": "hook",
            "routes": [sh("t", f"[ -e {ok} ]")]}).start()
        d.ctl("add", "often", "t", "@every 1s", "--concurrency", "allow",
              "--max-attempts", "1")
        wait_until(lambda: [r["outcome"] for r in history(d, "often")].count("failed") >= 3,
                   20, what="three failed occurrences")
        ok.touch()
        wait_until(lambda: "success" in [r["outcome"] for r in history(d, "often")], 20,
                   what="an occurrence to succeed")
        wait_until(lambda: len(hook.events()) >= 2, 10, what="the notifications")
        time.sleep(1.0)  # nothing more comes
        assert hook.events() == [("failure", "failed"), ("recovery", "success")]
        assert all(doc["key"].startswith("often@run-") for doc in hook.docs)
    finally:
        hook.close()


FLOOD_JOBS = '''\
from perfectschedd import Application


class Fails(Application):
    def run(self):
        raise RuntimeError("down")
'''


def test_a_members_flood_does_not_delay_roots_failure(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    """Issue 38: 1,000 failing schedules of one member (uid 1000) whose receiver is slow
    (10 ms an answer: 0.2.0 queued root's behind some 500 of them per worker); root's one
    failing schedule, run once the flood is being told, is told within 3 s of its run's
    end; the member is told every one of its failures, none dropped."""
    count = 1000
    member_hook, root_hook = Receiver(delay=0.01), Receiver()
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "floodjobs.py").write_text(FLOOD_JOBS)
    try:
        d: Daemon = daemon_factory({
            "poll_interval": 0.2, "max_attempts": 1,
            "notifiers": {"member": {"webhook": member_hook.url},
                          "root": {"webhook": root_hook.url}},
            "routes": [{"type": "fail", "python": "floodjobs:Fails", "user": "root"}]},
            extra_args=["-I", str(mods)]).start()
        sc = ScheduleCollection(config.load(str(d.config_path)))
        try:
            # As a member's add_many over the socket stores them: its uid as creator.
            sc.add_many([{"key": f"alice-{i}", "type": "fail", "cron": YEARLY, "at": 0,
                          "creator": 1000, "notify": "member"} for i in range(count)])
            wait_until(lambda: len(member_hook.keys()) >= 20, 30,
                       what="the member's notifications to be under way")
            sc.add("root-job", "fail", YEARLY, at=0, creator=0, notify="root")
        finally:
            sc.close()
        (doc,) = wait_until(lambda: root_hook.docs, 15, what="root's notification")
        arrived = time.time()
        assert (doc["key"], doc["event"]) == ("root-job", "failure")
        assert arrived - doc["finished_at"] < 3.0, arrived - doc["finished_at"]
        # The member's flood was still being told when root's arrived.
        assert len(member_hook.keys()) < count
        wait_until(lambda: len(member_hook.keys()) >= count, 90,
                   what="every one of the member's notifications")
        time.sleep(0.5)  # nothing more comes
        assert sorted(member_hook.keys()) == sorted(f"alice-{i}" for i in range(count))
        _, samples = scrape(d.metrics_port)
        assert not value(samples, "perfectsched_notifications_dropped_total")
        assert value(samples, "perfectsched_notifications_total", kind="webhook",
                     result="sent") == count + 1
    finally:
        member_hook.close()
        root_hook.close()
