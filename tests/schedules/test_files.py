"""Schedules as files (SPEC "Declarative schedules and migration", issue #16) against real
daemons: convergence at start and on reload, exec entries as their own routes, two hosts
with the same files, broken files, and `perfectschedctl apply`."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import Daemon, lines, sh, wait_until

import perfectschedd

# Their PostgreSQL and MariaDB runs are make check's (conftest: slow_on_servers).
pytestmark = pytest.mark.slow_on_servers


def write(path: Path, entries: list[dict[str, Any]] | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = entries if isinstance(entries, str) else yaml.safe_dump(entries, sort_keys=False)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def listed(d: Daemon) -> dict[str, dict[str, Any]]:
    return {s["key"]: s for s in d.ctl_json("list")}


def fences(url: str, keys: list[str]) -> dict[str, int]:
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        return {k: row.fence for k in keys if (row := sc.store.get(k)) is not None}


def applies(d: Daemon) -> int:
    """How many times the daemon has applied its files (one summary line each)."""
    return d.log().count("schedules files: applied")


def reload(d: Daemon, refused: bool = False) -> str:
    """Reload, and wait for the apply that follows it (run once the store answers).
    `refused`: something of the files is refused, so the reload exits 1 saying what
    (returned: its stderr)."""
    before = applies(d)
    res = d.ctl("reload", check=False)
    assert res.returncode == (1 if refused else 0), res.stdout + res.stderr
    wait_until(lambda: applies(d) > before, what="the reload's apply")
    return res.stderr


ENTRIES = [
    {"key": "nightly", "cron": "0 3 * * *", "type": "t", "data": {"n": 1}},
    {"key": "hourly", "cron": "@hourly", "type": "t", "timezone": "Asia/Tokyo",
     "max_attempts": 3},
    {"key": "report", "cron": "30 6 * * 1", "type": "t", "jitter": 60},
]


def test_files_converge_at_start_and_on_reload(daemon_factory: Any, db_url: str,
                                               tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    write(sdir / "jobs.yml", ENTRIES)
    write(sdir / "other.yml", [{"key": "weekly", "cron": "@weekly", "type": "t"}])
    (sdir / "README").write_text("not a *.yml file: ignored\n")
    d: Daemon = daemon_factory({"schedules_dir": str(sdir), "routes": [sh("t", "true")]},
                               url=db_url).start()
    wait_until(lambda: len(d.ctl_json("list")) == 4, what="four schedules from the files")
    # reload() counts the summaries: the start's may still be queued in the log writer.
    wait_until(lambda: applies(d) == 1, what="the start's apply in the log")
    got = listed(d)
    assert {k: v["source"] for k, v in got.items()} == {
        "nightly": "file:jobs.yml", "hourly": "file:jobs.yml", "report": "file:jobs.yml",
        "weekly": "file:other.yml"}
    assert got["hourly"]["timezone"] == "Asia/Tokyo" and got["hourly"]["max_attempts"] == 3
    assert got["nightly"]["data"] == {"n": 1} and got["report"]["jitter"] == 60
    d.ctl("add", "manual", "t", "@daily")
    assert d.ctl_json("show", "manual")["source"] == "api"
    before = listed(d)
    fence_before = fences(db_url, ["nightly", "report", "manual"])

    # Edit one cron, delete one entry, add one; the rest stays as it was.
    edited = [dict(ENTRIES[0], cron="0 4 * * *"), ENTRIES[2],
              {"key": "fresh", "cron": "*/5 * * * *", "type": "t"}]
    write(sdir / "jobs.yml", edited)
    reload(d)
    after = listed(d)
    assert set(after) == {"nightly", "report", "fresh", "weekly", "manual"}
    assert after["nightly"]["cron"] == "0 4 * * *"
    assert after["nightly"]["next_time"] != before["nightly"]["next_time"]
    assert after["report"] == before["report"]  # unchanged: same times
    assert after["manual"] == before["manual"]
    assert after["fresh"]["source"] == "file:jobs.yml"
    now = fences(db_url, ["nightly", "report", "manual"])
    assert now["report"] == fence_before["report"] and now["manual"] == fence_before["manual"]
    assert now["nightly"] > fence_before["nightly"]
    log = d.log()
    assert "changed nightly (cron)" in log and "added fresh" in log
    assert "report" not in log.split("removed hourly")[1]  # nothing written for it

    # A broken file: rejected whole, logged, its schedules as they were; the daemon runs.
    write(sdir / "other.yml", [{"key": "weekly", "cron": "@weekly", "type": "t"},
                               {"key": "bad", "cron": "61 * * * *", "type": "t"}])
    assert "other.yml: entry 2 (bad): cron" in reload(d, refused=True)
    assert "schedules file rejected" in d.log()
    assert "other.yml: entry 2 (bad): cron" in d.log()
    assert set(listed(d)) == {"nightly", "report", "fresh", "weekly", "manual"}
    assert d.alive()
    # Fixed again, and emptied: its schedule goes.
    write(sdir / "other.yml", "# nothing here any more\n")
    reload(d)
    assert "removed weekly" in d.log()
    assert set(listed(d)) == {"nightly", "report", "fresh", "manual"}
    assert d.stop() == 0


def test_two_hosts_with_the_same_files_do_not_flap(daemon_factory: Any, db_url: str,
                                                   tmp_path: Path) -> None:
    dir_a, dir_b = tmp_path / "a.d", tmp_path / "b.d"
    write(dir_a / "jobs.yml", ENTRIES)
    write(dir_b / "jobs.yml", ENTRIES)
    a: Daemon = daemon_factory({"schedules_dir": str(dir_a), "routes": [sh("t", "true")]},
                               url=db_url).start()
    b: Daemon = daemon_factory({"schedules_dir": str(dir_b), "routes": [sh("t", "true")]},
                               url=db_url).start()
    wait_until(lambda: applies(a) == 1 and applies(b) == 1, what="both first applies")
    keys = [e["key"] for e in ENTRIES]
    settled = fences(db_url, keys)
    for i in range(10):
        reload(a if i % 2 else b)
    assert fences(db_url, keys) == settled  # no write at all
    for d in (a, b):
        assert "changed " not in d.log() and "removed " not in d.log()
    # Only a's file changes: a writes it; b, which did not change its file, says once
    # that it disagrees, and does not write its version back.
    write(dir_a / "jobs.yml", [dict(ENTRIES[0], cron="0 6 * * *"), *ENTRIES[1:]])
    reload(a)
    assert "changed nightly (cron)" in a.log()
    for _ in range(3):
        reload(b)
    assert b.log().count("differs nightly") == 1
    assert a.ctl_json("show", "nightly")["cron"] == "0 6 * * *"
    assert a.stop() == 0 and b.stop() == 0


def test_exec_entry_runs_on_the_hosts_that_hold_it(daemon_factory: Any, db_url: str,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "ran"
    sdir = tmp_path / "schedules.d"
    write(sdir / "exec.yml", [{
        "key": "shell-job", "cron": "0 0 1 1 *",
        "exec": f'echo "$GREETING $PERFECTSCHED_KEY $0" >> {out}',
        "env": {"GREETING": "hello from the file"}, "user": "root"}])
    holder: Daemon = daemon_factory({"schedules_dir": str(sdir), "node_name": "holder",
                                     "workers": 1}, url=db_url).start()
    other: Daemon = daemon_factory({"schedules_dir": "off",
                                    "node_name": "other", "workers": 2,
                                    "poll_interval": 0.1}, url=db_url).start()
    wait_until(lambda: "shell-job" in listed(other), what="the entry stored")
    assert listed(other)["shell-job"]["type"] == "exec:shell-job"
    for _ in range(6):
        other.ctl("run", "shell-job")
    wait_until(lambda: len(lines(out)) == 6, timeout=60, what="six runs")
    # The command line of a file is a shell line: no key appended, env from the file.
    for line in lines(out):  # extra runs are keyed KEY@run-...
        greeting, key, argv0 = line.rsplit(" ", 2)
        assert (greeting, argv0) == ("hello from the file", "/bin/sh")
        assert key.startswith("shell-job@run-")
    runs = wait_until(lambda: len(h := other.ctl_json("history", "shell-job")) == 6 and h,
                      what="six runs in history (written in batches)")
    assert all(r["worker"].startswith("holder:") for r in runs)
    assert holder.stop() == 0 and other.stop() == 0
    # The command and its environment stay in the file: nothing of them is stored.
    if db_url.startswith("sqlite:///"):
        db = Path(db_url.removeprefix("sqlite:///"))
        stored = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
        assert b"shell-job" in stored
        assert b"GREETING" not in stored and b"hello from the file" not in stored


def test_apply_notes_where_exec_entries_run_unless_the_file_is_the_daemon_s(
        daemon_factory: Any, tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    job = [{"key": "shell-job", "cron": "0 0 1 1 *", "exec": "true", "user": "root"}]
    write(sdir / "exec.yml", job)
    d: Daemon = daemon_factory({"schedules_dir": str(sdir)}).start()
    note = "note: 1 exec entry runs only on hosts whose schedules_dir holds the file"
    for args in (["--dry-run"], []):  # the daemon's own file: it reads it there
        res = d.ctl("apply", *args, str(sdir / "exec.yml"))
        assert note not in res.stderr, res.stderr
    elsewhere = tmp_path / "elsewhere" / "exec.yml"
    write(elsewhere, job)
    for args in (["--dry-run"], []):
        res = d.ctl("apply", *args, str(elsewhere))
        assert note in res.stderr, res.stderr
    assert d.stop() == 0


def test_apply_prints_changes_and_refuses_bad_files(daemon_factory: Any, tmp_path: Path
                                                    ) -> None:
    d: Daemon = daemon_factory({"schedules_dir": "off", "routes": [sh("t", "true")]}).start()
    f = tmp_path / "apply" / "team.yml"
    write(f, ENTRIES)
    assert d.ctl("apply", str(f), "--dry-run").stdout.splitlines() == [
        "added nightly", "added hourly", "added report"]
    assert d.ctl_json("list") == []
    out = d.ctl("apply", str(f)).stdout.splitlines()
    assert out == ["added nightly", "added hourly", "added report"]
    assert d.ctl("apply", str(f)).stdout.splitlines() == [
        "unchanged nightly", "unchanged hourly", "unchanged report"]
    write(f, [dict(ENTRIES[0], data={"n": 2}), ENTRIES[1]])
    assert d.ctl("apply", str(f)).stdout.splitlines() == [
        "changed nightly (data)", "unchanged hourly"]  # no removal without --prune
    assert d.ctl("apply", str(f), "--prune").stdout.splitlines() == [
        "unchanged nightly", "unchanged hourly", "removed report"]
    # A key made with add is never taken over: refused, nothing written.
    d.ctl("add", "mine", "t", "@daily")
    write(f, [ENTRIES[0], {"key": "mine", "cron": "@hourly", "type": "t"},
              {"key": "new", "cron": "@hourly", "type": "t"}])
    res = d.ctl("apply", str(f), check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == ("perfectschedctl: refused mine (the key belongs to api "
                                  "(made with add))")
    assert "new" not in listed(d) and listed(d)["mine"]["cron"] == "@daily"
    # The dry run says what apply does (issue 39 item 4): the same refusal, nothing else.
    dry = d.ctl("apply", "--dry-run", str(f), check=False)
    assert (dry.returncode, dry.stdout, dry.stderr) == (1, "", res.stderr)
    # Invalid entries: one line per problem, exit 1, nothing written.
    write(f, textwrap.dedent("""\
        - key: ok
          cron: "@daily"
          type: t
        - key: -dash
          cron: "@daily"
          type: t
        - key: two
          cron: "@daily"
          type: t
          exec: [/bin/true]
        - key: three
          cron: "* * *"
          type: t
          misfire: sometimes
        """))
    res = d.ctl("apply", str(f), check=False)
    assert res.returncode == 1
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 3, errors
    assert errors[0].startswith(f"perfectschedctl: {f}: entry 2 (-dash): key: ")
    assert "entry 3 (two): type: needs exactly one of type or exec" in errors[1]
    assert "entry 4 (three): " in errors[2]
    assert "ok" not in listed(d)
    res = d.ctl("apply", str(tmp_path / "missing.yml"), check=False)
    assert res.returncode == 1 and "no such file" in res.stderr
    assert d.alive() and d.stop() == 0


NOBODY = 65534  # nobody:nogroup on Debian


def entry(key: str) -> list[dict[str, Any]]:
    return [{"key": key, "cron": "@daily", "type": "t"}]


def rejected(d: Daemon, name: str) -> list[str]:
    return [x for x in d.log().splitlines() if "schedules file rejected" in x and name in x]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users: needs root")
def test_files_follow_cron_s_ownership_rules(daemon_factory: Any, tmp_path: Path) -> None:
    """SPEC "Privilege model": a schedules file, and schedules_dir, is root's and not
    group- or world-writable; a symlink is followed only if root owns it (and what it
    points to passes too).  An offending file is rejected whole in one line, its
    schedules stay as they were, and the other files apply."""
    sdir, away = tmp_path / "schedules.d", tmp_path / "elsewhere"
    away.mkdir()
    write(sdir / "good.yml", entry("good"))
    write(sdir / "theirs.yml", entry("theirs"))
    os.chown(sdir / "theirs.yml", NOBODY, NOBODY)
    write(sdir / "group.yml", entry("group"))
    (sdir / "group.yml").chmod(0o664)
    write(sdir / "world.yml", entry("world"))
    (sdir / "world.yml").chmod(0o646)
    write(away / "roots.yml", entry("via-root-link"))
    (sdir / "linked.yml").symlink_to(away / "roots.yml")      # root's link, root's file
    write(away / "also-roots.yml", entry("via-their-link"))
    (sdir / "their-link.yml").symlink_to(away / "also-roots.yml")
    os.lchown(sdir / "their-link.yml", NOBODY, NOBODY)      # their link, root's file
    write(away / "nobodys.yml", entry("to-their-file"))
    os.chown(away / "nobodys.yml", NOBODY, NOBODY)
    (sdir / "to-theirs.yml").symlink_to(away / "nobodys.yml")  # root's link, their file
    d: Daemon = daemon_factory({"schedules_dir": str(sdir), "routes": [sh("t", "true")]}
                               ).start()
    wait_until(lambda: applies(d) == 1, what="the first apply")
    assert set(listed(d)) == {"good", "via-root-link"}
    why = {
        "theirs.yml": "owned by uid 65534 (nobody), not root: rejected",
        "group.yml": "group-writable (mode 0664): rejected",
        "world.yml": "world-writable (mode 0646): rejected",
        "their-link.yml": "a symlink owned by uid 65534 (nobody), not root: rejected",
        "to-theirs.yml": "owned by uid 65534 (nobody), not root: rejected",
    }
    for name, text in why.items():
        lines_of = rejected(d, f"{sdir / name}:")
        assert len(lines_of) == 1 and lines_of[0].endswith(f"{sdir / name}: {text}"), \
            (name, lines_of)

    # A file that stops being root's keeps its schedules as they were, though it changed.
    write(sdir / "good.yml", entry("sneaked-in"))
    os.chown(sdir / "good.yml", NOBODY, NOBODY)
    reload(d, refused=True)
    assert set(listed(d)) == {"good", "via-root-link"}
    # A schedules_dir others may write: nothing in it is read, everything stays.
    os.chown(sdir / "good.yml", 0, 0)
    (sdir / "linked.yml").unlink()
    sdir.chmod(0o775)
    reload(d, refused=True)
    assert set(listed(d)) == {"good", "via-root-link"}
    assert rejected(d, f"{sdir}: group-writable (mode 0775): none of its files are read")
    sdir.chmod(0o755)
    reload(d, refused=True)
    assert set(listed(d)) == {"sneaked-in"}
    assert d.stop() == 0
