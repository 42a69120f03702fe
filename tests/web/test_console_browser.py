"""The web console in a real headless Chromium (Debian's chromium, chromium-driver and
python3-selenium): log in with a token, find a schedule by its prefix, pause it, run it
now, see the run's exit code and output, be refused a change without the CSRF token and
a form posted from another origin; every stored string shown inert.  It also makes the
screenshot of the console that README shows: `PERFECTSCHED_UPDATE_SCREENSHOT=1 pytest
tests/web/test_console_browser.py` writes it to docs/console.png."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from api_client import make_token
from daemon_harness import YEARLY, sh

HERE = Path(__file__).parent
SCREENSHOT = HERE.parent.parent / "docs" / "console.png"

pytestmark = pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")
         and subprocess.run(["/usr/bin/python3", "-c", "import selenium"],
                            capture_output=True).returncode == 0),
    reason="needs Debian's chromium, chromium-driver and python3-selenium "
           "(tests/install-test-deps.sh)")


def attacker_page(target: str) -> tuple[http.server.HTTPServer, str]:
    """A page on another origin that posts a pause form to the console by itself."""
    page = (f'<html><body>forged<form id="f" method="post" action="{target}">'
            f'<input name="do" value="pause"></form>'
            f'<script>document.getElementById("f").submit()</script></body></html>').encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def test_a_browser_logs_in_pauses_runs_and_sees_the_output(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    d = daemon_factory({"routes": [sh("report", "echo '<script>alert(1)</script>' rows=42; "
                                                "exit 3")],
                        "workers": 1, "poll_interval": 0.2}).start()
    key = "nightly-report"
    d.ctl("add", key, "report", "0 3 * * *", '{"note": "<img src=x onerror=alert(2)>"}',
          "-t", "Europe/Paris")
    for i in range(3):
        d.ctl("add", f"other-{i}", "report", YEARLY)
    operator = make_token(d, "ops-console", "admin")
    console = f"http://127.0.0.1:{d.metrics_port}"
    server, attacker = attacker_page(f"{console}/schedules/{key}/resume")
    shot = tmp_path / "console.png"
    try:
        res = subprocess.run(["/usr/bin/python3", str(HERE / "browser_session.py"), console,
                              operator, key, attacker, str(shot)],
                             capture_output=True, text=True, timeout=240)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["redirected_to_login"] is True
    assert seen["overview_title"].startswith("Overview")
    assert seen["cookie"] == {"httpOnly": True, "sameSite": "Strict"}
    assert seen["found"] == [key]
    assert seen["schedule_title"].startswith(key)
    assert "CSRF token is missing or wrong" in seen["without_csrf"]
    assert f"{key}: paused" in seen["after_pause"]
    # The run: its exit code and output, the script tag shown as text, never run.
    assert "failed" in seen["runs"] and " 3 " in f" {seen['runs']} "
    assert any("<script>alert(1)</script> rows=42" in o for o in seen["outputs"]), seen
    assert seen["alert"] is False
    # Readable on a phone: no page is wider than its 390-pixel screen.
    # (scrollWidth leaves the scroll bar out, innerWidth counts it: <= 0 fits.)
    assert set(seen["phone_overflow"]) == {"/", "/schedules", f"/schedules/{key}"}
    assert all(v <= 0 for v in seen["phone_overflow"].values()), seen["phone_overflow"]
    # The forged post from another origin changed nothing: still paused.
    assert "resumed" not in seen["forged"]
    assert "paused True" in seen["after_forged"]
    assert json.loads(d.ctl("--json", "show", key).stdout)["paused"] is True
    assert d.stop() == 0
    # The README's picture of the console: made here, copied into docs/ on request
    # (a test run leaves the tree as it was).
    assert shot.stat().st_size > 10_000
    if os.environ.get("PERFECTSCHED_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)
