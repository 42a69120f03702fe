"""PerfectSched: a highly available distributed cron for Linux."""

from typing import Any

from .config import Config
from .errors import (
    AlreadyExistsError,
    AlreadyFinishedError,
    ConfigError,
    InvalidInputError,
    NotFoundError,
    NotSupportedError,
    PreemptedError,
    ProcessStopError,
    ScheduleError,
)
from .schedules import Schedule, ScheduleCollection, ScheduleInfo, Task, open

__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError", "AlreadyFinishedError", "Application", "Config", "ConfigError",
    "InvalidInputError", "NotFoundError", "NotSupportedError", "PreemptedError",
    "ProcessStopError", "Schedule", "ScheduleCollection", "ScheduleError", "ScheduleInfo",
    "Task", "open",
]


def __getattr__(name: str) -> Any:
    # handlers imports subprocess machinery the library API does not need.
    if name == "Application":
        from .handlers import Application

        return Application
    raise AttributeError(name)
