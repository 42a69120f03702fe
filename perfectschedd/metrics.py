"""Metric objects (placeholder interface; the full Prometheus implementation replaces it)."""

from __future__ import annotations


def task_started(task_type: str, lateness: float) -> None:
    pass


def task_finished(task_type: str, outcome: str, duration: float) -> None:
    pass


def lease_lost(task_type: str) -> None:
    pass


def db_error() -> None:
    pass


def set_db_up(ok: bool) -> None:
    pass


def after_fork_in_worker() -> None:
    pass


def worker_exited(pid: int) -> None:
    pass


def worker_restarted() -> None:
    pass


def set_schedule_counts(counts: dict[str, int]) -> None:
    pass


def set_workers(configured: int, alive: int) -> None:
    pass


def setup_master(config: object) -> None:
    pass


def serve(listen: tuple[str, int], healthy: object) -> None:
    return None
