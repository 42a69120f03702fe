"""The perfectschedd command: its arguments, the configuration, then the supervisor."""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys

from perfectschedd import __version__, config, logsetup
from perfectschedd.errors import ConfigError, NotSupportedError
from perfectschedd.master.supervisor import Supervisor

log = logging.getLogger("perfectschedd")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perfectschedd",
                                description="PerfectSched daemon (runs in the foreground).")
    p.add_argument("-c", "--config", metavar="CONFIG",
                   help=f"configuration file (default $PERFECTSCHED_CONFIG or "
                        f"{config.DEFAULT_CONFIG_PATH})")
    p.add_argument("-e", "--environment", metavar="ENV", help="section of a multi-env config")
    p.add_argument("-I", dest="include", metavar="PATH", action="append", default=[],
                   help="add PATH to the module search path (for python routes)")
    p.add_argument("-r", dest="require", metavar="MODULE", action="append", default=[],
                   help="import MODULE at start (for python routes)")
    p.add_argument("--version", action="version", version=f"perfectschedd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        logsetup.shutdown()  # write what the log queue still holds


def _main(argv: list[str] | None) -> int:
    ns = build_parser().parse_args(argv)
    source = ns.config or os.environ.get("PERFECTSCHED_CONFIG") or \
        config.DEFAULT_CONFIG_PATH
    logsetup.setup(None)
    try:
        cfg = config.load(source, ns.environment)
        # Host checks: perfectschedctl -c reads the file too, and needs neither.
        refusal = config.notify_refusal(cfg) or config.schedules_dir_refusal(cfg)
        if refusal is not None:
            raise ConfigError(refusal)
        logsetup.setup(cfg.log)
    except (ConfigError, NotSupportedError) as exc:
        log.error("%s", exc)
        return 1
    for path in reversed(ns.include):
        sys.path.insert(0, os.path.abspath(path))
    for module in ns.require:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - report any import failure in one line
            log.error("cannot import %s: %s", module, exc)
            return 1
    try:
        return Supervisor(cfg, source, ns.environment).run()
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EPERM):
            log.error("%s", exc)
            return 1
        raise
