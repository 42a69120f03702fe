"""Error classes of the public API (SPEC: "Errors")."""


class ScheduleError(Exception):
    """Base of every error about schedules and tasks."""


class AlreadyFinishedError(ScheduleError):
    """The task was already finished, retried or released by this holder."""


class NotFoundError(ScheduleError):
    """No schedule has this key."""


class PreemptedError(ScheduleError):
    """The lease on this task was lost (expired, deleted or modified)."""


class AlreadyExistsError(ScheduleError):
    """A schedule with this key already exists."""


class NotSupportedError(ScheduleError):
    """The configuration asks for something this build does not provide."""


class DatabaseUnavailableError(ScheduleError):
    """The database did not answer in time (or is not open yet); nothing was changed
    by this request, though a write may still complete once the database answers."""


class InvalidInputError(ScheduleError, ValueError):
    """A field of a request is not acceptable; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigError(RuntimeError):
    """The configuration file is unreadable or invalid."""


class ProcessStopError(RuntimeError):
    """Raised inside a handler when the daemon is stopping and the task must end."""
