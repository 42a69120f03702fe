"""The web console's rules over real HTTP (the browser's view is test_console_browser.py):
a session only from a token, its cookie's flags (HttpOnly, SameSite=Strict; Secure and
the __Host- name under TLS), the CSRF token of every form, a POST from another origin,
a viewer's read-only pages, a revoked token's session ended, every stored string
escaped; and HTTPS with a throw-away certificate, for the console and the API."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from api_client import Answer, call, make_token, revoke_token
from daemon_harness import YEARLY, Daemon, sh, wait_until

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


class Browser:
    """Cookies and forms, by hand: what a browser sends, nothing more."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.port = port
        self.tls = tls
        self.jar: dict[str, str] = {}
        self.set_cookies: list[str] = []

    def request(self, method: str, path: str, fields: dict[str, str] | None = None,
                headers: dict[str, str] | None = None) -> Answer:
        sent = dict(headers or {})
        if self.jar:
            sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.jar.items())
        raw = None
        if fields is not None:
            raw = urllib.parse.urlencode(fields).encode()
            sent.update(FORM)
        answer = call(self.port, method, path, raw=raw, headers=sent, tls=self.tls)
        for cookie in answer.headers.get_all("Set-Cookie") or []:
            self.set_cookies.append(cookie)
            name, _, rest = cookie.partition("=")
            value = rest.split(";", 1)[0]
            if "Max-Age=0" in cookie:
                self.jar.pop(name, None)
            else:
                self.jar[name] = value
        return answer

    def login(self, token: str) -> Answer:
        form = self.request("GET", "/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', form.body.decode())
        assert csrf is not None
        return self.request("POST", "/login", {"csrf": csrf.group(1), "token": token})

    def csrf(self, path: str) -> str:
        page = self.request("GET", path).body.decode()
        found = re.search(r'name="csrf" value="([^"]+)"', page)
        assert found is not None, page
        return found.group(1)


def start(daemon_factory: Any, **overrides: Any) -> Daemon:
    return daemon_factory({"routes": [sh("t", "echo '<b>bold</b>'")], "workers": 1,
                           "poll_interval": 0.2, **overrides}).start()


def test_sessions_cookies_csrf_and_roles(daemon_factory: Any) -> None:
    d = start(daemon_factory)
    d.ctl("add", "k1", "t", YEARLY, '{"html": "<script>alert(1)</script>"}')
    admin = make_token(d, "admin1", "admin")
    viewer = make_token(d, "view1", "viewer")
    port = d.metrics_port

    anonymous = Browser(port)
    a = anonymous.request("GET", "/schedules")
    assert a.status == 303 and a.headers["Location"] == "/login"
    a = anonymous.request("POST", "/schedules/k1/pause", {"csrf": "x"})
    assert a.status == 401
    bad = Browser(port)
    assert bad.login("pst_1_nope").status == 401
    stale = Browser(port)
    stale.request("GET", "/login")
    a = stale.request("POST", "/login", {"csrf": "not-the-cookie's", "token": admin})
    assert a.status == 403 and "perfectsched_session" not in stale.jar

    b = Browser(port)
    a = b.login(admin)
    assert a.status == 303 and a.headers["Location"] == "/"
    (cookie,) = [c for c in b.set_cookies if c.startswith("perfectsched_session=")]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
    page = b.request("GET", "/schedules/k1")
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp  # no script at all
    text = page.body.decode()
    assert "<script>alert(1)" not in text and "&lt;script&gt;alert(1)" in text
    assert "<script" not in text
    # A change: without the token, with a wrong one, from another origin: refused.
    csrf = b.csrf("/schedules/k1")
    for fields, headers in (({}, {}), ({"csrf": "wrong"}, {}),
                            ({"csrf": csrf}, {"Origin": "http://evil.example"}),
                            ({"csrf": csrf}, {"Sec-Fetch-Site": "cross-site"})):
        a = b.request("POST", "/schedules/k1/pause", fields, headers)
        assert a.status == 403, (fields, headers, a.status)
    assert d.ctl_json("show", "k1")["paused"] is False
    a = b.request("POST", "/schedules/k1/pause", {"csrf": csrf},
                  {"Origin": f"http://127.0.0.1:{port}"})
    assert a.status == 303 and d.ctl_json("show", "k1")["paused"] is True
    assert "k1: paused" in b.request("GET", "/schedules/k1").body.decode()
    a = b.request("POST", "/schedules/k1/run", {"csrf": csrf})
    assert a.status == 303
    wait_until(lambda: "&lt;b&gt;bold&lt;/b&gt;" in b.request("GET", "/schedules/k1")
               .body.decode(), what="the run's output, escaped")

    # A viewer: pages without buttons or data; a change refused by the same rules.
    v = Browser(port)
    v.login(viewer)
    text = v.request("GET", "/schedules/k1").body.decode()
    assert "button" not in text.split("<main>")[1] and "alert(1)" not in text
    assert "withheld" in text
    a = v.request("POST", "/schedules/k1/resume", {"csrf": v.csrf("/")})
    assert a.status == 403 and "role viewer" in a.body.decode()
    assert d.ctl_json("show", "k1")["paused"] is True
    listing = v.request("GET", "/schedules?prefix=k&state=paused&limit=10").body.decode()
    assert 'href="/schedules/k1"' in listing
    assert v.request("GET", "/").status == 200

    # Revoked: the session ends within the tokens' refresh.
    revoke_token(d, "admin1")
    wait_until(lambda: b.request("GET", "/").status == 303, timeout=10,
               what="the revoked token's session ended")
    # Log out ends the session at once.
    assert v.request("POST", "/logout", {"csrf": v.csrf("/")}).status == 303
    assert v.request("GET", "/").status == 303
    assert d.stop() == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_https_with_a_throw_away_certificate(daemon_factory: Any, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True,
                   capture_output=True)
    # On every address, with TLS: the API and the console are served.
    d = daemon_factory({"routes": [sh("t", "true")],
                        "http_tls": {"cert": str(cert), "key": str(key)}})
    d.config["http_listen"] = d.config.pop("metrics_listen").replace("127.0.0.1", "0.0.0.0")
    d.write_config()
    d.start()
    token = make_token(d, "t1", "viewer")
    context = ssl.create_default_context(cafile=str(cert))
    a = call(d.metrics_port, "GET", "/api/v1/status", token, tls=context)
    assert a.status == 200 and a.json["state"] == "running"
    assert call(d.metrics_port, "GET", "/metrics", tls=context).status == 200
    b = Browser(d.metrics_port, context)
    assert b.login(token).status == 303
    (cookie,) = [c for c in b.set_cookies if "perfectsched_session=" in c
                 and "Max-Age=0" not in c]
    assert cookie.startswith("__Host-perfectsched_session=") and "; Secure" in cookie
    assert b.request("GET", "/").status == 200
    # Plain HTTP to the TLS port, and a client that does not trust the certificate.
    with pytest.raises(Exception):  # noqa: B017 - a closed connection, by any name
        call(d.metrics_port, "GET", "/metrics")
    with pytest.raises(ssl.SSLCertVerificationError):
        call(d.metrics_port, "GET", "/metrics", tls=ssl.create_default_context())
    assert d.status()["state"] == "running"
    # A key that does not load: one line at a reload, the listener stays as it was.
    key.write_text("not a key\n")
    d.config["http_insecure"] = True  # a change, so that the listener is made again
    d.write_config()
    res = d.ctl("reload", check=False)
    assert res.returncode != 0 and "http_tls: cannot load the certificate" in res.stderr
    assert call(d.metrics_port, "GET", "/api/v1/status", token, tls=context).status == 200
    assert d.stop() == 0
