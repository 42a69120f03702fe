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


class PermissionDeniedError(ScheduleError):
    """The caller may not do this (control/auth.py): a route that runs as another user, a
    schedules file's schedule, or --force without being root.  `conflict`: refused
    because a schedules file owns the schedule (HTTP answers 409, not 403)."""

    def __init__(self, message: str = "", *, conflict: bool = False) -> None:
        super().__init__(message)
        self.conflict = conflict


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


def first_line(exc: BaseException) -> str:
    """An exception as one log line (a driver's message may run over many)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def describe(value: object, limit: int = 60) -> str:
    """A user-given value for an error message: a bounded repr for scalars, the type's
    name for anything else (the repr of a YAML alias bomb or a deeply nested request would
    cost exponential time and memory, or recurse too deep)."""
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            return "a whole number too large"
        text = repr(value)
        return text if len(text) <= limit else text[:limit - 3] + "..."
    return f"a {type(value).__name__}"


class SchemaError(ConfigError):
    """The database cannot be used by this version, and waiting will not change that: its
    schema is newer than this version understands, or is not one it can use.  The daemon
    stops its start on it (no READY=1) instead of retrying."""


# A worker's exit status when it met a SchemaError (sysexits' EX_CONFIG): the master
# stops the daemon instead of replacing it.
EXIT_UNUSABLE_DATABASE = 78
