"""A real HTTP scrape of a daemon's /metrics, parsed by prometheus_client's own parser:
shared by the metrics tests and the whole-daemon tests that read a counter."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def scrape(port: int) -> tuple[str, Samples]:
    code, ctype, text = get(port, "/metrics")
    assert code == 200, text
    assert ctype.startswith("text/plain; version=0.0.4"), ctype
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of the samples named `name` whose labels include `labels`; None if none."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return sum(found) if found else None
