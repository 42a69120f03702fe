"""Forced deletes of schedules files' schedules, and when their entries come back.

Root's `delete --force` of a schedule whose source is file:NAME records a marker in the
meta table, in the delete's own transaction (store: delete's `marker`): its name is
fields.deleted_marker_name(key), its value a digest of the schedule as the database held
it (key, source and every field a file's entry sets) followed by the source.  Every
convergence of files (a daemon's start and reloads, `apply`, on every host of the
database) leaves out an entry whose digest is the marker's, so the delete holds until:
- the file's entry for the key changes (its digest differs): it is added again and the
  marker goes;
- the entry leaves its file: the marker goes with it (a convergence that would remove
  the schedule, were it there, forgets the marker), so the same entry added back later is
  added again;
- the key is added by any other way (`add`, `import`, a changed entry): the store drops
  the marker in the insert's transaction.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from perfectschedd.schedules import policy
from perfectschedd.vocabulary.fields import deleted_marker_name

# Policy options newer than the forced delete (0.2.0): in the digest only when an entry
# sets them, so that a marker an older release recorded still matches the same entry
# (the first build of 0.3.0 counted `metrics: null` in, and brought back every entry
# force-deleted under 0.2.0).  A new option goes here, never into the list below.
LATER_OPTIONS = ("metrics",)
# What a schedules file's entry sets (files.Entry.stored): the digest covers these.
ENTRY_FIELDS = ("type", "cron", "timezone", "delay", "data",
                *(o for o in policy.OPTIONS if o not in LATER_OPTIONS))
VALUE_MAX = 255  # the meta table's value column
_DIGEST_LEN = 64


def digest(key: str, source: str, fields: Mapping[str, Any]) -> str:
    """The digest of a schedule of `source` as a file's entry sets it (`fields`: an
    entry's stored(), or a stored schedule's as_dict())."""
    shown = {"key": key, "source": source, **{n: fields.get(n) for n in ENTRY_FIELDS}}
    shown.update({n: fields[n] for n in LATER_OPTIONS if fields.get(n) is not None})
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def marker(key: str, source: str, fields: Mapping[str, Any]) -> str:
    """The marker's value: the digest, then the source (cut to fit; for people reading
    the table, and to find the markers of one file)."""
    return f"{digest(key, source, fields)} {source}"[:VALUE_MAX]


def marker_digest(value: str) -> str:
    return value[:_DIGEST_LEN]


def marker_of_source(value: str, source: str) -> bool:
    """Whether a marker's value names `source` (as marker() cut it)."""
    return value[_DIGEST_LEN + 1:] == source[:VALUE_MAX - _DIGEST_LEN - 1]


def name(key: str) -> str:
    return deleted_marker_name(key)
