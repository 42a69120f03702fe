"""`python -m perfectschedctl ARGV...` for many argument vectors in one process.

A perfectschedctl process spends 0.3-0.5 s of CPU on its imports (a direct-mode one a
database login too): the package is imported once, then each vector runs its __main__
afresh with fd 1 and 2 on files of its own, so that whatever it writes (print, argparse,
a logging handler made earlier) is its own, and an exception escaping it is printed as
the interpreter would print it, with exit 1.  The answer also says which perfectschedctl
was imported (a release's, or this tree's)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = r"""
import json, os, runpy, sys, tempfile, traceback
import perfectschedctl
results = []
for argv in json.load(sys.stdin):
    sys.argv = ["perfectschedctl", *argv]
    outs = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(outs[0].fileno(), 1); os.dup2(outs[1].fileno(), 2)
    try:
        try:
            runpy.run_module("perfectschedctl", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    text = []
    for f in outs:
        f.seek(0)
        text.append(f.read().decode(errors="replace"))
        f.close()
    results.append([code, text[0], text[1]])
sys.__stdout__.write(json.dumps({"file": perfectschedctl.__file__, "results": results}))
"""


@dataclass(frozen=True)
class Batch:
    file: str  # the perfectschedctl package the batch imported
    results: list[subprocess.CompletedProcess[str]]


def run_batch(python: list[str], argvs: list[list[str]], *, env: dict[str, str] | None = None,
              cwd: Path | None = None, timeout: float = 120) -> Batch:
    """Run every vector of `argvs` in one `python` process (a command: the interpreter
    and any options before `-c`).  The batch itself must exit 0."""
    res = subprocess.run([*python, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=str(cwd) if cwd else None,
                         input=json.dumps(argvs))
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    results = [subprocess.CompletedProcess(argv, code, stdout, stderr)
               for argv, (code, stdout, stderr) in zip(argvs, out["results"], strict=True)]
    return Batch(out["file"], results)
