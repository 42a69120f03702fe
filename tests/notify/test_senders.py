"""The three kinds of notifiers against real receivers: a webhook server on loopback, a
sendmail stand-in script, a command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from notify_receivers import Receiver, mails, sendmail_stand_in

from perfectschedd.notify import senders
from perfectschedd.settings.notify_spec import Notifier

RUN = {"key": "backup", "type": "t", "scheduled_time": 1700000000, "attempt": 2,
       "started_at": 1700000001.0, "finished_at": 1700000003.5, "outcome": "failed",
       "exit_code": 3, "output": "disk full\n", "worker": "h:1"}


def message(event: str = "failure") -> senders.Message:
    return senders.Message(event, "host-a", dict(RUN))


def test_webhook_posts_one_json_document() -> None:
    r = Receiver()
    try:
        senders.send(Notifier("webhook", r.url), message(), sendmail="/nonexistent")
        assert r.requests == [("POST", "/hook")]
        doc = r.docs[0]
        assert (doc["event"], doc["key"], doc["outcome"], doc["exit_code"], doc["host"],
                doc["attempt"], doc["output"], doc["duration"]) == (
            "failure", "backup", "failed", 3, "host-a", 2, "disk full\n", 2.5)
    finally:
        r.close()


def test_webhook_errors_and_timeouts_are_send_errors() -> None:
    bad, hung = Receiver("500"), Receiver("hang")
    try:
        with pytest.raises(senders.SendError, match="HTTP 500"):
            senders.send_webhook(bad.url, message())
        with pytest.raises(senders.SendError, match="TimeoutError|timed out"):
            senders.send_webhook(hung.url, message(), timeout=0.5)
    finally:
        bad.close()
        hung.close()


def test_a_redirect_to_another_host_is_not_followed() -> None:
    elsewhere = Receiver()
    # "localhost" is another host name than 127.0.0.1, though the same machine.
    r = Receiver("redirect", location=f"http://localhost:{elsewhere.port}/stolen")
    try:
        with pytest.raises(senders.SendError, match="redirect to another host"):
            senders.send_webhook(r.url, message())
        assert elsewhere.requests == []
    finally:
        r.close()
        elsewhere.close()


def test_a_redirect_on_the_same_origin_keeps_the_post() -> None:
    target = Receiver()
    r = Receiver("redirect", location=f"http://127.0.0.1:{target.port}/moved")
    try:
        # Same host name, another port: another origin, so not followed either.
        with pytest.raises(senders.SendError, match="another host"):
            senders.send_webhook(r.url, message())
        assert target.requests == []
        r.location = "/moved-here"  # relative: the same origin, followed (as a POST)
        with pytest.raises(senders.SendError, match="more than 3 redirects"):
            senders.send_webhook(r.url, message())  # it redirects to itself forever
        assert r.requests[1:] == [("POST", "/hook")] + [("POST", "/moved-here")] * 3
    finally:
        r.close()
        target.close()


def test_mail_goes_through_sendmail_t(tmp_path: Path) -> None:
    script, out = sendmail_stand_in(tmp_path)
    senders.send(Notifier("mail", "ops@example.com"), message(), sendmail=str(script))
    (mail,) = mails(out)
    assert mail.startswith("ARGS: -t -oi\n")
    assert "To: ops@example.com" in mail
    assert "Subject: [perfectsched] backup FAILED: failed (exit 3) on host-a" in mail
    assert "disk full" in mail


def test_a_failing_sendmail_is_a_send_error(tmp_path: Path) -> None:
    with pytest.raises(senders.SendError, match="cannot run"):
        senders.send_mail("ops@example.com", message(), str(tmp_path / "missing"))
    failing = tmp_path / "failing-sendmail"
    failing.write_text("#!/bin/sh\ncat >/dev/null; echo 'no route to mail host' >&2; exit 75\n")
    failing.chmod(0o755)
    with pytest.raises(senders.SendError, match="status 75: no route to mail host"):
        senders.send_mail("ops@example.com", message(), str(failing))


def test_exec_gets_the_run_in_its_environment_and_the_output_on_stdin(tmp_path: Path) -> None:
    out = tmp_path / "told"
    script = ('printf "%s %s %s %s %s %s\\n" "$PERFECTSCHED_KEY" "$PERFECTSCHED_EVENT" '
              '"$PERFECTSCHED_OUTCOME" "$PERFECTSCHED_EXIT_CODE" "$PERFECTSCHED_ATTEMPT" '
              f'"$PERFECTSCHED_HOST" > {out}; cat >> {out}')
    senders.send(Notifier("exec", ("/bin/sh", "-c", script)), message(), sendmail="")
    assert out.read_text() == "backup failure failed 3 2 host-a\ndisk full\n"
    with pytest.raises(senders.SendError, match="status 4"):
        senders.send_exec(("/bin/sh", "-c", "exit 4"), message())


def test_document_is_json() -> None:
    json.dumps(message("recovery").document())
