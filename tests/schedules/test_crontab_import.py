"""perfectschedctl import-crontab (issue #16): Debian's own crontabs and a user crontab with
every feature, read by the real CLI, applied to a real database, and their next run times
checked against croniter for the next 10 occurrences (CRON_TZ/TZ honoured)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml
from croniter import croniter

from perfectschedd.schedules import cron

CTL = [sys.executable, "-m", "perfectschedctl"]
CORPUS = Path(__file__).resolve().parents[1] / "data" / "crontabs"
DEBIAN = sorted((CORPUS / "debian").iterdir())


def ctl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CTL, *args], input=stdin, capture_output=True, text=True,
                          timeout=60)


def imported(*args: str) -> tuple[list[dict[str, Any]], str, list[str]]:
    res = ctl("import-crontab", *args)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout), res.stdout, res.stderr.splitlines()


def job_lines(path: Path) -> int:
    """Lines that are jobs: not blank, not comments, not NAME=value."""
    n = 0
    for line in path.read_text().splitlines():
        s = line.strip()
        if s and not s.startswith("#") and "=" not in s.split()[0]:
            n += 1
    return n


def oracle(expr: str, tz: str, after: int, count: int) -> list[int]:
    """cron's own next times, from croniter on an aware datetime."""
    it = croniter(cron.normalize(expr), datetime.fromtimestamp(after, ZoneInfo(tz)))
    return [int(it.get_next(datetime).timestamp()) for _ in range(count)]


def ours(expr: str, tz: str, first: int, count: int) -> list[int]:
    times = [first]
    while len(times) < count:
        times.append(cron.next_after(expr, tz, times[-1]))
    return times


def config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "perfectsched.yml"
    path.write_text(yaml.safe_dump({"type": "rdb_compat", "url": url}))
    return path


def apply_and_check_times(tmp_path: Path, url: str, files: list[Path]) -> dict[str, Any]:
    conf = str(config(tmp_path, url))
    assert ctl("-c", conf, "init").returncode == 0
    before = int(time.time())
    res = ctl("-c", conf, "apply", *map(str, files))
    after = int(time.time()) + 1
    assert res.returncode == 0, res.stderr
    assert all(line.startswith("added ") for line in res.stdout.splitlines()), res.stdout
    shown = {s["key"]: s for s in yaml.safe_load(ctl("-c", conf, "--json", "list").stdout)}
    for s in shown.values():
        expected = oracle(s["cron"], s["timezone"], before - 1, 2)
        # The first occurrence at or after the apply (one may have passed while it ran).
        assert s["next_time"] == expected[0] or (
            expected[0] < after and s["next_time"] == expected[1]), s
        assert ours(s["cron"], s["timezone"], s["next_time"], 10) == \
            oracle(s["cron"], s["timezone"], s["next_time"] - 1, 10), s["key"]
    return shown


@pytest.mark.slow_on_servers
def test_debian_crontabs_import_apply_and_keep_cron_times(tmp_path: Path, db_url: str
                                                          ) -> None:
    files = []
    total = 0
    for src in DEBIAN:
        entries, text, warnings = imported(str(src), "--system")
        assert warnings == []
        assert len(entries) == job_lines(src), src.name
        for e in entries:
            assert e["user"] == "root" and isinstance(e["exec"], str)
        out = tmp_path / "schedules" / f"{src.name}.yml"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text)
        files.append(out)
        total += len(entries)
    crontab = imported(str(CORPUS / "debian" / "crontab"), "--system")[0]
    assert crontab[0]["cron"] == "17 * * * *"
    assert crontab[0]["exec"] == "cd / && run-parts --report /etc/cron.hourly"
    assert crontab[0]["env"] == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin"}
    shown = apply_and_check_times(tmp_path, db_url, files)
    assert len(shown) == total == 11
    assert {s["source"] for s in shown.values()} == {f"file:{f.name}" for f in files}


@pytest.mark.slow_on_servers
def test_user_crontab_with_every_feature(tmp_path: Path, db_url: str) -> None:
    src = CORPUS / "user-crontab"
    entries, text, warnings = imported(str(src), "--user", "nobody")
    by_cron = {e["cron"]: e for e in entries}
    assert len(entries) == 8
    assert all(e["user"] == "nobody" for e in entries)
    # Variables apply to the lines after them; CRON_TZ and TZ switch the zone.
    assert by_cron["*/15 9-17 * * mon-fri"]["timezone"] == "Asia/Tokyo"
    assert by_cron["5 4 * * *"]["timezone"] == "Europe/Berlin"
    assert by_cron["*/15 9-17 * * mon-fri"]["env"] == {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "GREETING": "hello  world",
        "QUOTED": "single quotes"}
    assert "MAILTO" not in str([e.get("env") for e in entries])
    # cron's ways: MAILTO mails the output of every line after it; no retries.
    assert "# MAILTO=ops@example.com" in text
    assert all(e["notify"] == {"mail": "ops@example.com", "when": "output"}
               for e in entries)
    assert all(e["max_attempts"] == 1 for e in entries)
    # The unknown zone leaves the previous one in force.
    assert by_cron["0 6 * * *"]["timezone"] == "Europe/Berlin"
    assert by_cron["0 6 * * *"]["exec"][:2] == ["/bin/bash", "-c"]  # SHELL=/bin/bash
    assert by_cron["@hourly"]["exec"] == "/usr/local/bin/rotate"
    # One warning per line not carried over, each named by file and line.
    assert [w.split(": ", 3)[2] for w in warnings] == [
        "user-crontab:15", "user-crontab:16", "user-crontab:17", "user-crontab:18"]
    assert "@reboot" in warnings[1] and "not imported" in text
    # % as crontab(5) says, run for real by the shell the entry names.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**os.environ, "OUT_DIR": str(out_dir)}
    for expr in ("@daily", "5 4 * * *", "0 6 * * *"):
        argv = by_cron[expr]["exec"]
        argv = ["/bin/sh", "-c", argv] if isinstance(argv, str) else argv
        subprocess.run(argv, env=env, check=True, timeout=10)
    assert (out_dir / "mail").read_text() == "Joe,\n\nWhere are your kids?\n"
    assert (out_dir / "date").read_text().strip() == time.strftime("%Y-%m-%d")
    assert (out_dir / "bash").read_text().strip()  # bash set $BASH_VERSION
    # Stable keys: the same file gives the same keys; a line whose schedule changes keeps
    # its key, so apply after an edit changes exactly that entry.
    assert [e["key"] for e in imported(str(src), "--user", "nobody")[0]] == \
        [e["key"] for e in entries]
    assert len({e["key"] for e in entries}) == 8  # /usr/local/bin/rotate twice: -2
    schedules = tmp_path / "user.yml"
    schedules.write_text(text)
    apply_and_check_times(tmp_path, db_url, [schedules])
    edited = src.read_text().replace("0 0 1,15 * *", "0 1 1,15 * *")
    res = ctl("import-crontab", "--user", "nobody", "-", stdin=edited)
    schedules.write_text(res.stdout)
    applied = ctl("-c", str(tmp_path / "perfectsched.yml"), "apply", str(schedules))
    changed = [line for line in applied.stdout.splitlines() if not line.startswith("unch")]
    billing = next(e["key"] for e in entries if "billing" in e["key"])
    assert changed == [f"changed {billing} (cron)"], applied.stdout


@pytest.mark.parametrize("args,message", [
    (["/nonexistent/crontab", "--user", "nobody"],
     "perfectschedctl: /nonexistent/crontab: No such file or directory"),
    ([str(CORPUS / "user-crontab"), "--system", "--user", "x"],
     "perfectschedctl: --user is for a user crontab; a system crontab names its users"),
])
def test_import_crontab_refuses_with_one_line(args: list[str], message: str) -> None:
    res = ctl("import-crontab", *args)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip() == message


def test_a_system_crontab_line_without_a_user_is_not_imported() -> None:
    res = ctl("import-crontab", "--system", "-", stdin="0 * * * * /bin/true\n@daily\n")
    assert res.returncode == 0
    assert yaml.safe_load(res.stdout) == []
    assert len(res.stderr.splitlines()) == 2


# -- whose jobs, and files cron itself would not read (SPEC "Privilege model") -------------

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users and "
                                "mounts over /etc in a namespace of its own")
JOB = "0 * * * * /bin/true\n"
SYSTEM_JOB = "0 * * * * root /bin/true\n"


def refused(res: subprocess.CompletedProcess[str], line: str) -> None:
    assert res.returncode == 1 and res.stdout == "", res
    assert res.stderr.splitlines() == [f"perfectschedctl: {line}"], res.stderr


@pytest.mark.parametrize("args", [["-"], [str(CORPUS / "user-crontab")]])
def test_a_user_crontab_needs_its_user(args: list[str]) -> None:
    """Nothing else says whose jobs they are: without --user they would run as whoever
    the daemon runs them as."""
    where = "standard input" if args == ["-"] else args[0]
    refused(ctl("import-crontab", *args, stdin=JOB),
            f"{where}: a user crontab needs --user NAME (whose jobs they are), or its path "
            "in /var/spool/cron/crontabs/NAME")
    refused(ctl("import-crontab", "--user", "nobody", "/etc/crontab"),
            "--user is for a user crontab; a system crontab names its users")


def put(path: Path, text: str, uid: int = 0, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def ctl_over(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """perfectschedctl ARGS in a mount namespace of its own, where root/etc and
    root/var/spool lie over the host's /etc and /var/spool (overlays: the host's own files
    are never touched, and cron, if it runs, never sees these)."""
    mounts = []
    for d in ("etc", "var/spool"):
        upper, work = root / d, root.parent / "overlay-work" / d
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        mounts.append(f"mount -t overlay overlay -o lowerdir=/{d},upperdir={upper},"
                      f"workdir={work} /{d}")
    script = " && ".join([*mounts, 'exec "$@"'])
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           script, "sh", *CTL, "import-crontab", *args],
                          capture_output=True, text=True, timeout=60)


@needs_root
def test_etc_cron_d_files_follow_cron_s_rules(tmp_path: Path) -> None:
    root = tmp_path / "root"
    crond = root / "etc" / "cron.d"
    put(crond / "good_one-2", SYSTEM_JOB)
    assert yaml.safe_load(ctl_over(root, "/etc/cron.d/good_one-2").stdout)[0]["user"] == "root"
    for name in ("backup.dpkg-old", "backup.bak", "backup.yml", "back up"):
        put(crond / name, SYSTEM_JOB)
        refused(ctl_over(root, f"/etc/cron.d/{name}"),
                f"/etc/cron.d/{name}: cron does not read it: the name of a file in "
                "/etc/cron.d has only letters, digits, _ and - (the run-parts rule)")
    put(crond / "theirs", SYSTEM_JOB, NOBODY)
    refused(ctl_over(root, "/etc/cron.d/theirs"),
            "/etc/cron.d/theirs: owned by uid 65534 (nobody), not root: rejected")
    put(crond / "shared", SYSTEM_JOB, mode=0o664)
    refused(ctl_over(root, "/etc/cron.d/shared"),
            "/etc/cron.d/shared: group-writable (mode 0664): rejected")
    put(root / "etc" / "away", SYSTEM_JOB)
    (crond / "linked").symlink_to("../away")
    assert ctl_over(root, "/etc/cron.d/linked").returncode == 0  # root's link, root's file
    os.lchown(crond / "linked", NOBODY, NOBODY)
    refused(ctl_over(root, "/etc/cron.d/linked"),
            "/etc/cron.d/linked: a symlink owned by uid 65534 (nobody), not root: rejected")


@needs_root
def test_etc_crontab_is_root_s_and_not_writable_by_others(tmp_path: Path) -> None:
    root = tmp_path / "root"
    crontab = put(root / "etc" / "crontab", SYSTEM_JOB)
    assert ctl_over(root, "/etc/crontab").returncode == 0
    crontab.chmod(0o646)
    refused(ctl_over(root, "/etc/crontab"),
            "/etc/crontab: world-writable (mode 0646): rejected")
    crontab.chmod(0o644)
    os.chown(crontab, NOBODY, NOBODY)
    refused(ctl_over(root, "/etc/crontab"),
            "/etc/crontab: owned by uid 65534 (nobody), not root: rejected")


@needs_root
def test_a_spool_crontab_is_its_owner_s(tmp_path: Path) -> None:
    root = tmp_path / "root"
    spool = root / "var" / "spool" / "cron" / "crontabs"
    put(spool / "nobody", JOB, NOBODY, 0o600)
    res = ctl_over(root, "/var/spool/cron/crontabs/nobody")
    assert res.returncode == 0, res.stderr
    entry = yaml.safe_load(res.stdout)[0]
    assert entry["user"] == "nobody" and entry["key"].startswith("nobody-true-")
    refused(ctl_over(root, "--user", "daemon", "/var/spool/cron/crontabs/nobody"),
            "/var/spool/cron/crontabs/nobody: nobody's crontab, not daemon's")
    # As cron: a crontab in the spool is its user's (or root's), and a user of this host.
    os.chown(spool / "nobody", 1, 1)
    refused(ctl_over(root, "/var/spool/cron/crontabs/nobody"),
            "/var/spool/cron/crontabs/nobody: owned by uid 1 (daemon), not root or "
            "uid 65534 (nobody): rejected")
    put(spool / "no-such-user-x", JOB, mode=0o600)
    refused(ctl_over(root, "/var/spool/cron/crontabs/no-such-user-x"),
            "/var/spool/cron/crontabs/no-such-user-x: no user no-such-user-x on this host "
            "(cron ignores the crontab of a user it does not know)")


# -- crontab(5)'s % text never becomes shell code -------------------------------------------

INJECTIONS = {
    # The text holds the here-document's delimiter: what follows it was run as code.
    "delimiter": ('@daily cat > "$OUT_DIR/in"%first%PERFECTSCHED_INPUT%touch "$OUT_DIR/pwned"%',
                  'first\nPERFECTSCHED_INPUT\ntouch "$OUT_DIR/pwned"\n'),
    # A comment at the end of the command hid the redirection: the text ran as commands.
    "comment": ('@daily cat > "$OUT_DIR/in" # keep a copy%touch "$OUT_DIR/pwned"%',
                'touch "$OUT_DIR/pwned"\n'),
    # An open quote in the command took the redirection in, and the text went on as code
    # (cron runs nothing: `echo '` does not parse).
    "quote": ("@daily echo '%'; touch \"$OUT_DIR/pwned\" #", None),
}


@pytest.mark.parametrize("case", INJECTIONS)
def test_percent_text_is_only_ever_standard_input(tmp_path: Path, case: str) -> None:
    line, want = INJECTIONS[case]
    res = ctl("import-crontab", "--user", "nobody", "-", stdin=line + "\n")
    assert res.returncode == 0, res.stderr
    argv = yaml.safe_load(res.stdout)[0]["exec"]
    argv = ["/bin/sh", "-c", argv] if isinstance(argv, str) else argv
    subprocess.run(argv, env={**os.environ, "OUT_DIR": str(tmp_path)},
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    assert not (tmp_path / "pwned").exists()
    if want is not None:
        assert (tmp_path / "in").read_text() == want


def test_the_delimiter_is_absent_from_the_text() -> None:
    """Whatever lines the text holds, the here-document ends where it was meant to."""
    from perfectschedd.schedules.from_crontab import convert
    text = "\n".join(["@daily cat%a%" + "%".join(
        f"PERFECTSCHED_INPUT{s}" for s in ("", "_1", "_2", "_3"))])
    entry = yaml.safe_load(convert(text, name="t", system=False, user="nobody").text)[0]
    out = subprocess.run(["/bin/sh", "-c", entry["exec"]], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=10, check=True).stdout
    assert out == "a\nPERFECTSCHED_INPUT\nPERFECTSCHED_INPUT_1\nPERFECTSCHED_INPUT_2\n" \
        "PERFECTSCHED_INPUT_3\n"


SYSTEM_CRONTAB_WITH_MAILTO = ("0 1 * * * backup /usr/local/bin/a\n"
                              "MAILTO=ops@example.com, dev@example.com\n"
                              "0 2 * * * root /usr/local/bin/b\n"
                              'MAILTO=""\n'
                              "0 3 * * * root /usr/local/bin/c\n")


def test_mailto_becomes_the_notify_that_gives_cron_s_mail(tmp_path: Path) -> None:
    # A system crontab: without MAILTO each line's user (its owner) gets the output, as
    # from cron; several addresses stay one comma-joined entry; MAILTO="" mails nothing.
    from perfectschedd.schedules.from_crontab import convert

    sendmail = tmp_path / "sendmail"
    sendmail.write_text("#!/bin/sh\ncat > /dev/null\n")
    sendmail.chmod(0o755)
    done = convert(SYSTEM_CRONTAB_WITH_MAILTO, name="jobs", system=True,
                   sendmail=str(sendmail))
    assert done.warnings == []
    entries = yaml.safe_load(done.text)
    assert [e.get("notify") for e in entries] == [
        {"mail": "backup", "when": "output"},
        {"mail": "ops@example.com,dev@example.com", "when": "output"},
        "none"]
    assert "(no MAILTO: its output is mailed to its owner backup, as cron does)" in done.text
    assert done.text.count("no MAILTO") == 1
    assert all(e["max_attempts"] == 1 for e in entries)
    # A user crontab without MAILTO: its user.
    (entry,) = yaml.safe_load(convert("* * * * * /bin/true\n", name="stdin", system=False,
                                      user="nobody", sendmail=str(sendmail)).text)
    assert entry["notify"] == {"mail": "nobody", "when": "output"}
    # The schedules file loader takes what the importer writes (apply end to end is
    # test_user_crontab_with_every_feature's).
    from perfectschedd.schedules import files

    out = tmp_path / "jobs.yml"
    out.write_text(done.text)
    loaded = files.load([out], need_user_support=False)
    assert loaded.errors == []
    assert [(n.kind, n.target, n.when) for n in (e.notify for e in loaded.entries.values())
            if n is not None] == [("mail", "backup", "output"),
                                  ("mail", "ops@example.com,dev@example.com", "output"),
                                  ("none", "", "change")]
    assert {e.policy.max_attempts for e in loaded.entries.values()} == {1}


def test_without_sendmail_a_crontab_without_mailto_mails_nobody(tmp_path: Path) -> None:
    """Where nothing can send mail, cron's mail to the owner is not carried over (a mail
    notifier there would get the file refused by the daemon): a comment says so; an
    explicit MAILTO is still carried over (the user asked for it)."""
    from perfectschedd.schedules.from_crontab import convert

    done = convert(SYSTEM_CRONTAB_WITH_MAILTO, name="jobs", system=True,
                   sendmail=str(tmp_path / "no-sendmail"))
    entries = yaml.safe_load(done.text)
    assert [e.get("notify") for e in entries] == [
        None, {"mail": "ops@example.com,dev@example.com", "when": "output"}, "none"]
    assert "cron would mail its output to its owner backup" in done.text
