"""Notifiers in the configuration (settings/notify_spec.py through config.from_mapping): what is
taken, and bad notifier settings refused in one line naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from perfectschedd import config
from perfectschedd.errors import ConfigError, InvalidInputError
from perfectschedd.schedules import files, policy
from perfectschedd.settings import notify_spec

BASE = {"type": "rdb_compat", "url": "sqlite:////tmp/x.db"}


def load(**extra: Any) -> config.Config:
    return config.from_mapping({**BASE, **extra})


def test_named_default_and_route_notifiers() -> None:
    c = load(notifiers={"ops": {"webhook": "https://hooks.example/x"},
                        "mails": {"mail": "root@example.com", "when": "every-failure"},
                        "pager": {"exec": ["/usr/local/bin/page", "-q"], "when": "output"}},
             notify="ops",
             routes=[{"type": "a", "exec": ["/bin/true"], "notify": "mails"},
                     {"type": "b", "exec": ["/bin/true"], "notify": "none"},
                     {"type": "c", "exec": ["/bin/true"],
                      "notify": {"webhook": "http://127.0.0.1:9/h"}}],
             sendmail="/usr/lib/sendmail")
    assert c.notifier("ops") == notify_spec.Notifier("webhook", "https://hooks.example/x",
                                              "change", "ops")
    assert c.notify is c.notifier("ops")
    assert c.routes[0].notify is c.notifier("mails")
    assert c.routes[0].notify.when == "every-failure"
    assert c.routes[1].notify is notify_spec.SILENT
    assert c.routes[2].notify.kind == "webhook"
    assert c.notifier("pager").target == ("/usr/local/bin/page", "-q")
    assert c.sendmail == "/usr/lib/sendmail"
    assert load().all_notifiers() == []


@pytest.mark.parametrize(("extra", "named"), [
    ({"notifiers": {"x": {"webhook": "ftp://h/"}}}, "notifiers.x.webhook: "),
    ({"notifiers": {"x": {"webhook": "http:///nohost"}}}, "notifiers.x.webhook: "),
    ({"notifiers": {"x": {"mail": "not an address"}}}, "notifiers.x.mail: "),
    ({"notifiers": {"x": {"mail": "a@b\nBcc: c@d"}}}, "notifiers.x.mail: "),
    ({"notifiers": {"x": {"exec": "echo hi"}}}, "notifiers.x.exec: "),
    ({"notifiers": {"x": {"exec": ["relative/prog"]}}}, "notifiers.x.exec: "),
    ({"notifiers": {"x": {"webhook": "http://h/", "when": "always"}}}, "notifiers.x.when: "),
    ({"notifiers": {"x": {"webhook": "http://h/", "mail": "a@b.c"}}}, "notifiers.x: "),
    ({"notifiers": {"x": {"sms": "123"}}}, "notifiers.x.sms: "),
    ({"notifiers": {"x": "http://h/"}}, "notifiers.x: "),
    ({"notifiers": {"bad name": {"webhook": "http://h/"}}}, "notifiers: "),
    ({"notifiers": ["x"]}, "notifiers: "),
    ({"notify": "nobody"}, "notify: no notifier named 'nobody'"),
    ({"notify": {"mail": 3}}, "notify.mail: "),
    ({"routes": [{"type": "t", "exec": ["/bin/true"], "notify": "ghost"}]},
     "routes[0].notify: no notifier named 'ghost'"),
    ({"sendmail": "sendmail"}, "sendmail: "),
])
def test_bad_notifier_settings_are_refused_in_one_line_naming_the_key(
        extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(**extra)
    message = str(err.value)
    assert message.startswith(named), message
    assert "\n" not in message


def test_mail_without_sendmail_is_a_host_refusal(tmp_path: Any) -> None:
    c = load(notifiers={"m": {"mail": "ops@example.com"}}, sendmail=str(tmp_path / "none"))
    why = config.notify_refusal(c)
    assert why is not None and why.startswith("sendmail: ") and "\n" not in why
    # Only a mail notifier needs it; an executable sendmail satisfies it.
    assert config.notify_refusal(load(sendmail=str(tmp_path / "none"))) is None
    assert config.notify_refusal(
        load(notifiers={"m": {"mail": "ops@example.com"}}, sendmail="/bin/true")) is None


def test_a_schedule_stores_a_name_only() -> None:
    assert policy.check({"notify": "ops"}) == {"notify": "ops"}
    assert policy.check({"notify": ""}) == {"notify": None}
    assert policy.check({"notify": "none"}) == {"notify": None}
    for bad in ({"webhook": "http://h/"}, "a b", "-x", 3):
        with pytest.raises(InvalidInputError, match="^notify: "):
            policy.check({"notify": bad})
    assert policy.from_text(policy.DEFAULT.changed({"notify": "ops"}).to_text()).notify == "ops"


def test_schedules_file_entries_take_a_name_inline_or_none() -> None:
    base = {"key": "k", "cron": "@daily", "exec": ["/bin/true"]}
    named = files.check_entry({**base, "notify": "ops"}, "file:a.yml")
    assert named.policy.notify == "ops" and named.notify is None
    inline = files.check_entry({**base, "notify": {"mail": "a@b.example"}}, "file:a.yml")
    assert inline.policy.notify is None and inline.notify is not None
    assert inline.notify.target == "a@b.example"
    silent = files.check_entry({**base, "notify": "none"}, "file:a.yml")
    assert silent.notify is notify_spec.SILENT
    with pytest.raises(InvalidInputError, match=r"^notify\.webhook: "):
        files.check_entry({**base, "notify": {"webhook": "gopher://x"}}, "file:a.yml")
    # What `apply` sends over the socket: a name, never an inline notifier.
    with pytest.raises(InvalidInputError, match="^notify: only a notifier's name"):
        files.check_entry({"key": "k", "cron": "@daily", "type": "t",
                           "notify": {"exec": ["/bin/sh"]}}, "file:a.yml", stored_only=True)
