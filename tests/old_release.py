"""A past release of PerfectSched, taken from git history, run beside this tree.

    old = materialise(tmp_dir)                  # release 0.1.0 (commit 0ffb1ea)
    old.ctl("-c", config, "init")               # its perfectschedctl
    Daemon(tmp, cfg, command=old.daemon_command, ctl_command=old.ctl_command)

`git archive COMMIT perfectschedd perfectschedctl` is extracted into a directory and run
with this interpreter and its libraries: `env PYTHONPATH=DIR PYTHONSAFEPATH=1 python -m
perfectschedd`.  PYTHONPATH comes before site-packages (this tree's editable install is
found after it), and PYTHONSAFEPATH keeps `python -m` from putting the working directory
(the repository root, where pytest runs) first on sys.path; `materialise` checks that
both programs say they are the release and load it from DIR.

The checkout must hold the release's commit: CI clones with full history.  When it does
not (a shallow clone, a copy without .git), OldReleaseUnavailable says so.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("perfectschedd", "perfectschedctl")

# Released versions (packaging/debian/changelog) and their commits on main (SPEC "Upgrades").
RELEASES = {"0.1.0": "0ffb1ea", "0.2.0": "ea31003"}


class OldReleaseUnavailable(RuntimeError):
    pass


def _git(*args: str, binary: bool = False) -> Any:
    try:
        res = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                             text=not binary, timeout=60)
    except FileNotFoundError:
        raise OldReleaseUnavailable("git is not installed: the upgrade tests take past "
                                    "releases from git history") from None
    if res.returncode != 0:
        err = res.stderr if isinstance(res.stderr, str) else res.stderr.decode(errors="replace")
        raise OldReleaseUnavailable(f"git {' '.join(args)}: {err.strip()}")
    return res.stdout


@dataclass(frozen=True)
class OldRelease:
    version: str
    commit: str
    path: Path  # holds perfectschedd/ and perfectschedctl/ of the release

    def env_prefix(self) -> list[str]:
        pythonpath = os.pathsep.join(p for p in (str(self.path),
                                                 os.environ.get("PYTHONPATH", "")) if p)
        return ["env", f"PYTHONPATH={pythonpath}", "PYTHONSAFEPATH=1", sys.executable]

    @property
    def daemon_command(self) -> list[str]:
        return [*self.env_prefix(), "-m", "perfectschedd"]

    @property
    def ctl_command(self) -> list[str]:
        return [*self.env_prefix(), "-m", "perfectschedctl"]

    def ctl(self, *args: str, check: bool = True, timeout: float = 60.0
            ) -> subprocess.CompletedProcess[str]:
        """The release's perfectschedctl (`-c CONFIG ...` or `--socket PATH ...`)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
        res = subprocess.run([*self.ctl_command, *args], capture_output=True, text=True,
                             timeout=timeout, env=env, cwd=str(self.path))
        if check and res.returncode != 0:
            raise AssertionError(f"perfectschedctl {self.version} {' '.join(args)} -> "
                                 f"{res.returncode}\n{res.stdout}{res.stderr}")
        return res

    def ctl_json(self, *args: str) -> Any:
        return json.loads(self.ctl("--json", *args).stdout)


def materialise(dest: Path, version: str = "0.1.0") -> OldRelease:
    """Extract `version` from git history into `dest` (made if missing; reused when it
    already holds that commit) and check that it runs as itself."""
    commit = RELEASES[version]
    _git("rev-parse", "--git-dir")
    try:
        full = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").strip()
    except OldReleaseUnavailable:
        raise OldReleaseUnavailable(
            f"commit {commit} (release {version}) is not in the history of {ROOT}: the "
            "upgrade tests need a clone with full history (git fetch --unshallow)") from None
    dest = Path(dest)
    stamp = dest / ".commit"
    if not (stamp.exists() and stamp.read_text() == full):
        dest.mkdir(parents=True, exist_ok=True)
        tar = _git("archive", "--format=tar", full, *PACKAGES, binary=True)
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            # Our own history; the filter exists from Python 3.11.4 (Debian 12: 3.11.2).
            tf.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                   else {}))
        stamp.write_text(full)
    old = OldRelease(version, full, dest)
    _check(old)
    return old


def _check(old: OldRelease) -> None:
    """Both programs say they are the release, and load it from its directory (not this
    tree's packages, which the venv's editable install also offers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    for package in PACKAGES:
        res = subprocess.run([*old.env_prefix(), "-m", package, "--version"],
                             capture_output=True, text=True, timeout=60, env=env,
                             cwd=str(ROOT))
        said = (res.stdout + res.stderr).strip()
        if res.returncode != 0 or said != f"{package} {old.version}":
            raise OldReleaseUnavailable(f"{package} of {old.commit} run from {old.path} "
                                        f"says {said!r} (exit {res.returncode}), not "
                                        f"{package} {old.version}")
    probe = "import perfectschedd, perfectschedctl; " \
            "print(perfectschedd.__file__); print(perfectschedctl.__file__)"
    res = subprocess.run([*old.env_prefix(), "-c", probe], capture_output=True, text=True,
                         timeout=60, env=env, cwd=str(ROOT))
    files = res.stdout.split()
    if res.returncode != 0 or len(files) != 2 or not all(
            Path(f).resolve().is_relative_to(old.path.resolve()) for f in files):
        raise OldReleaseUnavailable(f"release {old.version} does not load from {old.path}: "
                                    f"{res.stdout.strip()} {res.stderr.strip()}")
