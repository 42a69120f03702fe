"""The limits and markers of a schedule's fields, shared by validation, the importers,
the config and the store.  Kept apart from the table definitions (store/schema.py) so
that what only checks input never loads SQLAlchemy."""

from __future__ import annotations

import json
from typing import Any

# Extra runs of a schedule (perfectschedctl run) are one-off rows keyed KEY@run-....
RUN_NOW_MARK = "@run-"
# The source of a schedule from a schedules file: file:NAME (NULL: made with `add`).
SOURCE_FILE = "file:"
# The type of a schedules file's exec entry: exec:KEY (schedules.check_type keeps it for
# them), routed to the command of that entry on the hosts whose files hold it.
EXEC_TYPE = "exec:"
KEY_MAX = 256
TYPE_MAX = 256
CRON_MAX = 256
TZ_MAX = 64
DATA_MAX = 65536
PAUSED_REASON_MAX = 400
POLICY_MAX = 400
SOURCE_MAX = 300
UNIT_MAX = 255  # systemd's longest unit name
# The last second of year 9999: the calendar ends here (datetime, and so croniter, knows
# no year 10000); it bounds every time and duration we store (and keeps them in 64 bits).
LAST_INSTANT = 253402300799


def dumps_data(data: Any) -> str:
    """A schedule's data as stored: compact JSON with sorted keys."""
    # allow_nan=False: NaN/Infinity are not JSON; other clients could not read them.
    return json.dumps(data, separators=(",", ":"), sort_keys=True, allow_nan=False)
