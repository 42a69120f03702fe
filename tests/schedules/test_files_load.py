"""Reading schedules files (perfectschedd/schedules/files.py): what an entry may hold, and
the one-line errors for what it may not; `user:` only where the daemon can honour it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import Daemon, foreign_python, wait_until

from perfectschedd.schedules import files


def load_one(tmp_path: Path, entries: Any, **kw: Any) -> files.Loaded:
    f = tmp_path / "one.yml"
    f.write_text(entries if isinstance(entries, str) else yaml.safe_dump(entries))
    return files.load([f], **kw)


GOOD = {"key": "k", "cron": "@daily", "type": "t"}


def test_a_good_file(tmp_path: Path) -> None:
    loaded = load_one(tmp_path, [
        GOOD, {"key": "e", "cron": "0 * * * *", "exec": ["/bin/echo", "hi"],
               "env": {"A": "1", "B": 2}, "timeout": 30, "misfire": "latest",
               "concurrency": "allow", "data": {"x": [1]}}])
    assert loaded.errors == [] and loaded.sources == {"file:one.yml"}
    e = loaded.entries["e"]
    assert e.type == "exec:e" and e.exec == ("/bin/echo", "hi")
    assert e.env == (("A", "1"), ("B", "2")) and e.policy.timeout == 30
    assert e.policy.concurrency == "allow" and loaded.entries["k"].policy.concurrency == "forbid"
    route = e.route()
    assert route is not None and route.pattern == "exec:e" and not route.append_key
    assert loaded.entries["k"].route() is None  # a type entry runs on the config's routes
    assert files.load([tmp_path / "nothing-here"]).errors[0].endswith(
        "cannot read: No such file or directory")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")
def test_each_file_s_owner_is_recorded(tmp_path: Path) -> None:
    """Who made a file's schedules (their creator): the file's owner."""
    for name, uid in (("root.yml", 0), ("nobody.yml", 65534)):
        (tmp_path / name).write_text(yaml.safe_dump([{**GOOD, "key": name[:-4]}]))
        os.chown(tmp_path / name, uid, -1)
    loaded = files.load([tmp_path])
    assert loaded.owners == {"file:root.yml": 0, "file:nobody.yml": 65534}


@pytest.mark.parametrize("entry,error", [
    ({**GOOD, "colour": "red"}, "colour: unknown field"),
    ({"cron": "@daily", "type": "t"}, "key: must be a non-empty string"),
    ({**GOOD, "key": "-x"}, "key: must not start with '-'"),
    ({"key": "k", "type": "t"}, "cron: required"),
    ({**GOOD, "cron": "61 * * * *"}, "cron: "),
    ({**GOOD, "cron": "@once"}, "cron: @once is not for schedules files"),
    ({"key": "k", "cron": "@daily"}, "type: needs exactly one of type or exec"),
    ({**GOOD, "exec": "true"}, "type: needs exactly one of type or exec"),
    ({**GOOD, "type": "exec:k"}, "type: 'exec:' is kept for the exec entries of schedules "
                                   "files"),
    ({"key": "k", "cron": "@daily", "exec": []}, "exec: must be a shell line or"),
    ({"key": "k", "cron": "@daily", "exec": "  "}, "exec: must not be empty"),
    ({**GOOD, "timezone": "Mars/Base"}, "timezone: unknown time zone"),
    ({**GOOD, "delay": -1}, "delay: must be a whole number"),
    ({**GOOD, "misfire": "sometimes"}, "misfire: must be one of all, latest, skip"),
    ({**GOOD, "concurrency": "parallel"},
     "concurrency: must be one of forbid, allow, replace"),
    ({**GOOD, "max_attempts": "many"}, "max_attempts: must be a whole number"),
    ({**GOOD, "data": [1]}, "data: must be a JSON object"),
    ({**GOOD, "env": {"A": "1"}}, "env: only for exec entries"),
    ({"key": "k", "cron": "@daily", "exec": "true", "env": {"1A": "x"}},
     "env: bad variable name"),
    ({"key": "k", "cron": "@daily", "exec": "true", "env": {"A": ["x"]}},
     "env: A: must be text"),
    ({**GOOD, "user": "root"}, "user: only for exec entries"),
    ({"key": "k", "cron": "@daily", "exec": "true", "user": "no-such-user-here"},
     "user: no such user 'no-such-user-here' on this host"),
])
def test_bad_entries_reject_the_file_with_one_line_each(tmp_path: Path, entry: Any,
                                                        error: str) -> None:
    loaded = load_one(tmp_path, [{"key": "fine", "cron": "@daily", "type": "t"}, entry])
    assert loaded.entries == {} and loaded.broken == {"file:one.yml"}
    assert len(loaded.errors) == 1
    assert "one.yml: entry 2" in loaded.errors[0]
    assert error in loaded.errors[0], loaded.errors[0]


@pytest.mark.parametrize("text,error", [
    ("key: k\n", "must be a list of schedule entries"),
    ("- [unclosed\n", "not valid YAML"),
    ("- 5\n", "entry 1: entry: must be a mapping"),
    ("- {key: a, cron: '@daily', type: t}\n- {key: a, cron: '@daily', type: t}\n",
     "entry 2 (a): key 'a' appears twice in this file"),
])
def test_bad_files(tmp_path: Path, text: str, error: str) -> None:
    loaded = load_one(tmp_path, text)
    assert loaded.entries == {} and error in loaded.errors[0], loaded.errors


def test_a_key_in_two_files_rejects_the_second(tmp_path: Path) -> None:
    (tmp_path / "a.yml").write_text(yaml.safe_dump([GOOD]))
    (tmp_path / "b.yml").write_text(yaml.safe_dump([GOOD, {**GOOD, "key": "other"}]))
    loaded = files.load([tmp_path])
    assert loaded.sources == {"file:a.yml"} and loaded.broken == {"file:b.yml"}
    assert set(loaded.entries) == {"k"}
    assert loaded.errors == [f"{tmp_path / 'b.yml'}: key 'k' is also in a.yml"]
    assert load_one(tmp_path, "# only comments\n").entries == {}  # empty: no schedules


def test_user_needs_a_daemon_that_can_switch_users(tmp_path: Path) -> None:
    """As an unprivileged user, `user:` of anyone else is refused at load (the daemon
    could not honour it); `apply` from a workstation does not ask."""
    f = tmp_path / "u.yml"
    f.write_text(yaml.safe_dump([{"key": "k", "cron": "@daily", "exec": "id",
                                  "user": "daemon"}]))
    code = textwrap.dedent(f"""
        from perfectschedd.schedules import files
        print(files.load([{str(f)!r}]).errors)
        print(files.load([{str(f)!r}], need_user_support=False).errors)
    """)
    f_copy = Path(tempfile.mkdtemp(prefix="perfectsched-user-")) / "u.yml"
    f_copy.parent.chmod(0o755)
    f_copy.write_text(f.read_text())
    code = code.replace(str(f), str(f_copy))
    out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                          *foreign_python(), "-c", code], capture_output=True, text=True,
                         cwd="/", check=True).stdout.splitlines()
    shutil.rmtree(f_copy.parent)
    assert "user: running as 'daemon' needs the daemon to run as root" in out[0]
    assert out[1] == "[]"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a job as another user: needs root")
def test_an_exec_entry_runs_as_its_user(daemon_factory: Any, tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    (sdir / "u.yml").write_text(yaml.safe_dump([{
        "key": "as-nobody", "cron": "0 0 1 1 *", "user": "nobody",
        "exec": 'echo "ran as $(id -u):$(id -g) home=$HOME user=$USER in $(pwd)"'}]))
    d: Daemon = daemon_factory({"schedules_dir": str(sdir)}).start()
    wait_until(lambda: d.ctl_json("list"), what="the entry")
    d.ctl("run", "as-nobody")
    wait_until(lambda: "ran as 65534:65534" in d.log(), what="the job's output")
    assert "home=/nonexistent user=nobody in /" in d.log()  # nobody's home does not exist
    assert d.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a job as another user: needs root")
def test_an_exec_route_runs_as_its_user_with_its_env(daemon_factory: Any) -> None:
    """A route's `user` and `env` (SPEC: "User= from user" holds for routes as for
    entries): the job runs as that user, cron-like, with the route's variables."""
    d: Daemon = daemon_factory({"routes": [{
        "type": "whoami", "user": "nobody", "env": {"GREETING": "hello there", "N": 3},
        "exec": ["/bin/sh", "-c", 'echo "route ran as $(id -u):$(id -g) user=$USER '
                                  'greeting=$GREETING n=$N key=$1"', "sh"]}]}).start()
    d.ctl("add", "route-as-nobody", "whoami", "0 0 1 1 *")
    d.ctl("run", "route-as-nobody")
    wait_until(lambda: "route ran as" in d.log(), what="the job's output")
    assert ("route ran as 65534:65534 user=nobody greeting=hello there n=3 "
            "key=route-as-nobody") in d.log()

    # A reload naming a user this host lacks refuses that route alone, in one line (the
    # reload exits non-zero); its runs wait until a reload fixes it.
    good = dict(d.config)
    d.write_config({**good, "routes": [{**good["routes"][0], "user": "no-such-user-x"}]})
    res = d.ctl("reload", check=False)
    assert res.returncode == 1, res
    assert res.stderr.strip().endswith(
        "routes[0].user: no such user 'no-such-user-x' on this host"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    # The old workers run the old routes until they have retired.
    wait_until(lambda: all(w["generation"] == 1 for w in d.status()["workers"]),
               what="the old workers gone")
    d.ctl("run", "route-as-nobody")
    time.sleep(2)
    assert d.log().count("route ran as 65534") == 1
    d.write_config(good)
    assert d.ctl("reload").returncode == 0
    wait_until(lambda: d.log().count("route ran as 65534") >= 2, what="a run after the fix")
    assert d.stop() == 0


# -- who may write a schedules file (SPEC "Privilege model": cron's rules) -------------------

NOBODY = 65534  # nobody:nogroup on Debian, here the daemon's user
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other users")
PLAIN = {"key": "plain", "cron": "@daily", "exec": "true"}


def owned(path: Path, entries: Any, uid: int = 0, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(entries))
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


@needs_root
def test_the_daemon_s_own_files_may_not_say_who_runs_a_job(tmp_path: Path) -> None:
    """A file of the daemon's user (its link, or its directory) schedules jobs that run as
    that user; naming a user or an executor is root's alone, so such a file is rejected
    whole in one line."""
    ours = owned(tmp_path / "d" / "ours.yml", [PLAIN], NOBODY)
    assert files.load([ours], daemon_uid=NOBODY).entries.keys() == {"plain"}
    for extra in ({"user": "nobody"}, {"executor": "exec"}):
        owned(ours, [PLAIN, {**PLAIN, "key": "who", **extra}], NOBODY)
        loaded = files.load([ours], daemon_uid=NOBODY)
        field = next(iter(extra))
        assert loaded.entries == {} and loaded.errors == [
            f"{ours}: entry 2 (who): {field}: only a file that root owns may name a user or "
            "an executor, and it is owned by uid 65534 (nobody): rejected"]
    roots = owned(tmp_path / "d" / "roots.yml", [{**PLAIN, "user": "nobody"}])
    assert files.load([roots], daemon_uid=NOBODY).errors == []
    link = tmp_path / "d" / "link.yml"
    link.symlink_to(roots)
    os.lchown(link, NOBODY, NOBODY)
    assert files.load([link], daemon_uid=NOBODY).errors == [
        f"{link}: entry 1 (plain): user: only a file that root owns may name a user or an "
        "executor, and a symlink to it is owned by uid 65534 (nobody): rejected"]
    # Their directory: they could swap any file in it, root's too.
    owned(ours, [PLAIN], NOBODY)
    os.chown(tmp_path / "d", NOBODY, NOBODY)
    loaded = files.load([tmp_path / "d"], daemon_uid=NOBODY)
    assert loaded.sources == {"file:ours.yml"} and loaded.broken == {
        "file:link.yml", "file:roots.yml"}
    assert f"{roots}: entry 1 (plain): user: only a file that root owns may name a user " \
        "or an executor, and its directory is owned by uid 65534 (nobody): rejected" in \
        loaded.errors


@needs_root
@pytest.mark.parametrize("uid,mode,dir_mode,why", [
    (4321, 0o644, 0o755, "owned by uid 4321, not root or uid 65534 (nobody): rejected"),
    (0, 0o664, 0o755, "group-writable (mode 0664): rejected"),
    (NOBODY, 0o602, 0o755, "world-writable (mode 0602): rejected"),
    (0, 0o644, 0o757, "none of its files are read"),
])
def test_files_others_may_write_are_rejected(tmp_path: Path, uid: int, mode: int,
                                             dir_mode: int, why: str) -> None:
    f = owned(tmp_path / "d" / "x.yml", [PLAIN], uid, mode)
    f.parent.chmod(dir_mode)
    loaded = files.load([f.parent], daemon_uid=NOBODY)
    assert loaded.entries == {} and len(loaded.errors) == 1
    assert loaded.errors[0].endswith(why), loaded.errors
    if dir_mode == 0o757:
        assert loaded.errors[0] == (f"{f.parent}: world-writable (mode 0757): none of its "
                                    "files are read") and loaded.refused_dirs == {str(f.parent)}
    # perfectschedctl apply reads what its caller can: only stored fields leave it.
    assert files.load([f.parent]).entries.keys() == {"plain"}


@needs_root
def test_every_symlink_on_the_way_is_checked(tmp_path: Path) -> None:
    target = owned(tmp_path / "away" / "t.yml", [PLAIN])
    middle = tmp_path / "away" / "middle.yml"
    middle.symlink_to(target)
    os.lchown(middle, 4321, 4321)
    link = tmp_path / "d" / "x.yml"
    link.parent.mkdir()
    link.symlink_to("../away/middle.yml")  # relative, as ln -s makes them
    assert files.load([link.parent], daemon_uid=0).errors == [
        f"{link}: its symlink {link.parent}/../away/middle.yml owned by uid 4321, not root: "
        "rejected"]
    os.lchown(middle, 0, 0)
    assert files.load([link.parent], daemon_uid=0).entries.keys() == {"plain"}
    loop = tmp_path / "d" / "loop.yml"
    loop.symlink_to(loop)
    assert files.load([loop], daemon_uid=0).errors == [
        f"{loop}: too many levels of symbolic links: rejected"]


def test_a_fifo_is_not_read(tmp_path: Path) -> None:
    """Nothing writes to it: opening it for reading would wait forever."""
    fifo = tmp_path / "x.yml"
    os.mkfifo(fifo, 0o644)
    started = time.monotonic()
    assert files.load([fifo], daemon_uid=os.geteuid()).errors == [
        f"{fifo}: not a regular file: rejected"]
    assert time.monotonic() - started < 5


# -- YAML anchors and aliases ---------------------------------------------------------------

def alias_bomb() -> str:
    """A few hundred bytes that compose to 9**9 strings for whatever walks them."""
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        rows.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "- key: k\n  cron: '@daily'\n  type: t\n  data: {" + ", ".join(rows) + "}\n"


def test_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    """Refused as the loader meets the first anchor, before anything is composed from it
    (in a child with a deadline: before the fix it ran for ever)."""
    bomb = tmp_path / "x.yml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 450
    code = ("import sys, time\nfrom perfectschedd.schedules import files\n"
            "t = time.monotonic()\n"
            "errors = files.load([sys.argv[1]]).errors\n"
            "print(time.monotonic() - t)\nprint(*errors, sep='\\n')\n")
    res = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True,
                         text=True, timeout=60)
    took, *errors = res.stdout.splitlines()
    assert errors == [f"{bomb}: YAML anchors and aliases are not allowed (line 4)"], res
    assert float(took) < 0.1


@pytest.mark.parametrize("text,line", [
    ("- &e {key: a, cron: '@daily', type: t}\n- *e\n", 1),
    ("- {key: a, cron: '@daily', type: t, data: &d {x: 1}}\n", 1),
    ("- key: a\n  cron: '@daily'\n  type: t\n  data: {<<: *nowhere}\n", 4),
])
def test_anchors_and_aliases_are_refused(tmp_path: Path, text: str, line: int) -> None:
    loaded = load_one(tmp_path, text)
    assert loaded.entries == {} and loaded.errors == [
        f"{tmp_path / 'one.yml'}: YAML anchors and aliases are not allowed (line {line})"]


@pytest.mark.parametrize("value,error", [
    ("2024-13-45", "not valid YAML: month must be in 1..12"),
    ("9" * 5000, "not valid YAML: Exceeds the limit (4300 digits) for integer string "
                 "conversion"),
])
def test_values_yaml_cannot_build_are_one_line(tmp_path: Path, value: str, error: str) -> None:
    loaded = load_one(tmp_path, f"- {{key: a, cron: '@daily', type: t, data: {{d: {value}}}}}")
    assert loaded.entries == {} and len(loaded.errors) == 1
    assert loaded.errors[0].startswith(f"{tmp_path / 'one.yml'}: {error}"), loaded.errors
