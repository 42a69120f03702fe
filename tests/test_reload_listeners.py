"""Reload that needs new listeners: refused whole when one cannot be opened."""

from __future__ import annotations

import signal
import socket
import urllib.request

from daemon_harness import free_port, wait_until


def _scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return int(r.status)


def test_reload_to_a_busy_metrics_port_keeps_the_old_configuration(daemon_factory):
    d = daemon_factory().start()
    old_port = d.metrics_port
    assert _scrape(old_port) == 200
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        new_config = dict(d.config, metrics_listen=f"127.0.0.1:{busy.getsockname()[1]}",
                          workers=3)
        d.write_config(new_config)
        seen = len(d.messages())
        d.send_signal(signal.SIGHUP)
        d.wait_notify(lambda m: "READY=1" in m, after=seen, what="READY after reload")
        d.wait_log("reload failed")
        assert d.alive()
        assert _scrape(old_port) == 200  # old listener untouched
        assert d.status()["workers_configured"] == 2  # nothing of the new config applied
    finally:
        busy.close()


def test_reload_moves_metrics_to_a_new_port(daemon_factory):
    d = daemon_factory().start()
    old_port, new_port = d.metrics_port, free_port()
    d.write_config(dict(d.config, metrics_listen=f"127.0.0.1:{new_port}"))
    seen = len(d.messages())
    d.send_signal(signal.SIGHUP)
    d.wait_notify(lambda m: "READY=1" in m, after=seen, what="READY after reload")
    wait_until(lambda: _scrape(new_port) == 200, what="new metrics port")
    try:
        _scrape(old_port)
        raise AssertionError("old metrics port still answers")
    except OSError:
        pass
