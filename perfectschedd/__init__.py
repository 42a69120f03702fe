"""PerfectSched: a highly available distributed cron for Linux."""

from typing import Any

from perfectschedd.errors import (
    AlreadyExistsError,
    AlreadyFinishedError,
    ConfigError,
    DatabaseUnavailableError,
    InvalidInputError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
    PreemptedError,
    ProcessStopError,
    ScheduleError,
)

__version__ = "0.3.0"

__all__ = [
    "AlreadyExistsError", "AlreadyFinishedError", "Application", "Config", "ConfigError",
    "DatabaseUnavailableError", "InvalidInputError", "NotFoundError", "NotSupportedError",
    "PermissionDeniedError", "PreemptedError", "ProcessStopError", "Schedule",
    "ScheduleCollection", "ScheduleError", "ScheduleInfo", "Task", "open",
]


# Loaded on first use: perfectschedctl in socket mode needs only the errors and the
# protocol; SQLAlchemy would double its start time, and the config (YAML, the checks of
# routes) is not its business either.
_LAZY = {"Config": "config",
         "Schedule": "schedules.collection", "ScheduleCollection": "schedules.collection",
         "ScheduleInfo": "schedules.collection", "Task": "schedules.task",
         "open": "schedules.collection", "Application": "executors.application"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'perfectschedd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
