"""listeners.py on a real daemon: a reload that needs new listeners is refused whole when
one cannot be opened."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request

import yaml
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


def test_reload_answers_the_truth_and_a_later_good_reload_clears_the_error(daemon_factory):
    d = daemon_factory().start()
    good = dict(d.config)
    base = yaml.safe_dump(good)
    for bad, why in ((base + "kill_grace: -1\n", "kill_grace"),
                     ("type: rdb_compat\nurl: [unclosed\n", "not valid YAML"),
                     (base.replace("poll_interval: 0.5", "poll_interval: nope"),
                      "poll_interval")):
        d.write_config(raw=bad)
        res = d.ctl("reload", check=False)
        assert res.returncode == 1, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "reload rejected, the running configuration stays" in lines[0]
        assert why in lines[0], lines
        assert d.alive()
        assert d.status()["last_error"].startswith("reload: ")
    d.write_config(good)
    res = d.ctl("reload")
    assert res.stdout.startswith("reloaded: the new configuration runs"), res
    assert d.status()["last_error"] is None
    assert d.stop() == 0


def test_busy_metrics_port_at_start_names_the_setting_and_leaves_no_socket(daemon_factory):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        d = daemon_factory({"metrics_listen": f"127.0.0.1:{busy.getsockname()[1]}"})
        d.start(wait_ready=False)
        assert d.proc is not None and d.proc.wait(20) == 1
        log = d.log()
        assert "metrics_listen: cannot listen on 127.0.0.1:" in log
        assert "Address already in use" in log and "another perfectschedd?" in log
        assert not os.path.exists(d.socket_path)
    finally:
        busy.close()
