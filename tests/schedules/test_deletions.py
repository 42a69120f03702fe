"""deletions.py: a forced delete's marker keeps matching the same entry across releases
(the end-to-end case: tests/daemon/test_upgrade_db.py, 0.2.0's forced delete)."""

from __future__ import annotations

import hashlib
import json

from perfectschedd.schedules import deletions

# The fields 0.2.0 (commit ea31003) digested, in its order.
FIELDS_0_2_0 = ("type", "cron", "timezone", "delay", "data", "misfire", "grace",
                "max_attempts", "retry_wait", "jitter", "timeout", "notify", "concurrency")
ENTRY = {"type": "report", "cron": "0 6 * * *", "timezone": "UTC", "delay": 0,
         "data": {"to": "ops"}, "misfire": "all", "grace": None, "max_attempts": None,
         "retry_wait": None, "jitter": 0, "timeout": None, "notify": None,
         "concurrency": "forbid"}


def digest_0_2_0(key: str, source: str, fields: dict[str, object]) -> str:
    shown = {"key": key, "source": source, **{n: fields.get(n) for n in FIELDS_0_2_0}}
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def test_an_entry_without_newer_options_digests_as_0_2_0_did() -> None:
    old = digest_0_2_0("k", "file:jobs.yml", ENTRY)
    assert deletions.digest("k", "file:jobs.yml", ENTRY) == old
    assert deletions.digest("k", "file:jobs.yml", {**ENTRY, "metrics": None}) == old
    # An entry that sets a newer option has changed: its forced delete no longer holds.
    assert deletions.digest("k", "file:jobs.yml", {**ENTRY, "metrics": True}) != old
    assert deletions.digest("k", "file:jobs.yml", {**ENTRY, "metrics": False}) != old
