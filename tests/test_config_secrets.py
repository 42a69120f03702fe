"""Secrets in files (issue 38, SPEC "Privilege model"): the database password from
`password_file:` (a path, or a systemd credential's name), a webhook's bearer token and
URL from `token_file:` / `webhook_file:`.  Each bad case is one line naming the key and
the file, never the secret; a refused file loads nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from notify_receivers import Receiver
from sqlalchemy.engine.url import make_url

from perfectschedd import ConfigError
from perfectschedd.config import from_mapping, load, notify_refusal
from perfectschedd.notify import senders
from perfectschedd.settings.notify_spec import parse

PG = {"type": "rdb_compat", "url": "postgresql://sched@db.example.com:5432/sched"}
SECRET = "s3cret%41:@/ é"  # '%41' read back as 'A' by SQLAlchemy 1.4 if written raw


def secret_file(tmp_path: Path, text: str = SECRET + "\n", mode: int = 0o640,
                name: str = "dbpass") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_password_file_puts_the_password_in_the_url(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    url = make_url(from_mapping({**PG, "password_file": str(path)}).url)
    assert url.password == SECRET  # the final line break only is trimmed
    assert (url.username, url.host, url.port, url.database) == (
        "sched", "db.example.com", 5432, "sched")
    # a multi-host URL keeps its hosts
    multi = "postgresql://sched@/sched?host=a:5432&host=b:5432"
    url = make_url(from_mapping({**PG, "url": multi, "password_file": str(path)}).url)
    assert url.password == SECRET and url.query["host"] == ("a:5432", "b:5432")


def test_a_credential_name_is_read_from_credentials_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file(tmp_path, "from-systemd", mode=0o400)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert make_url(from_mapping({**PG, "password_file": "dbpass"}).url).password == \
        "from-systemd"
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError) as err:
        from_mapping({**PG, "password_file": "dbpass"})
    assert str(err.value).startswith("password_file: 'dbpass' is a systemd credential name")
    assert "CREDENTIALS_DIRECTORY is unset" in str(err.value)


def test_a_reload_sees_the_file_as_it_is_now(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    conf = tmp_path / "p.yml"
    conf.write_text(f"type: rdb_compat\nurl: {PG['url']}\npassword_file: {path}\n")
    assert make_url(load(str(conf)).url).password == SECRET
    path.write_text("rotated\n")
    assert make_url(load(str(conf)).url).password == "rotated"


@pytest.mark.parametrize(("case", "error"), [
    ("both", r"^password_file: url: holds a password as well"),
    ("sqlite", r"^password_file: a SQLite database takes no password$"),
    ("missing", r"^password_file: cannot read .*/nothing: No such file or directory$"),
    ("world", r"^password_file: .*/dbpass is readable by every user \(mode 0644\): "),
    ("directory", r"^password_file: .*/adir is not a regular file$"),
    ("empty", r"^password_file: .*/dbpass is empty$"),
    ("two lines", r"^password_file: .*/dbpass holds more than one line"),
    ("large", r"^password_file: .*/dbpass is larger than 4096 bytes$"),
    ("binary", r"^password_file: .*/dbpass is not UTF-8 text$"),
    ("relative", r"^password_file: 'etc/dbpass' is neither an absolute path nor a systemd "),
    ("not text", r"^password_file: must be an absolute path or a systemd credential name, "
                 r"got 42$"),
])
def test_a_bad_password_file_is_one_line_and_never_the_secret(
        tmp_path: Path, case: str, error: str) -> None:
    url, ref = PG["url"], str(tmp_path / "dbpass")
    if case == "both":
        url = "postgresql://sched:inline@db/sched"
        secret_file(tmp_path)
    elif case == "sqlite":
        url = f"sqlite:///{tmp_path}/x.db"
        secret_file(tmp_path)
    elif case == "missing":
        ref = str(tmp_path / "nothing")
    elif case == "world":
        secret_file(tmp_path, mode=0o644)
    elif case == "directory":
        (tmp_path / "adir").mkdir(mode=0o750)
        ref = str(tmp_path / "adir")
    elif case == "empty":
        secret_file(tmp_path, "\n")
    elif case == "two lines":
        secret_file(tmp_path, f"{SECRET}\nmore\n")
    elif case == "large":
        secret_file(tmp_path, "x" * 4097)
    elif case == "binary":
        (tmp_path / "dbpass").write_bytes(b"\xff\xfe")
        (tmp_path / "dbpass").chmod(0o600)
    elif case == "relative":
        ref = "etc/dbpass"
    elif case == "not text":
        ref = 42  # type: ignore[assignment]
    conf = tmp_path / "p.yml"
    conf.write_text(f"type: rdb_compat\nurl: '{url}'\npassword_file: {ref}\n")
    with pytest.raises(ConfigError) as err:
        load(str(conf))
    message = str(err.value).removeprefix(f"{conf}: ")
    assert len(message.splitlines()) == 1, message
    assert re.search(error, message), message
    assert SECRET not in message and "s3cret" not in message and "inline" not in message


def test_token_file_and_webhook_file_reach_a_real_receiver(tmp_path: Path) -> None:
    hook = Receiver()
    try:
        token = secret_file(tmp_path, "tok-1\n", name="token")
        url = secret_file(tmp_path, hook.url + "\n", name="url")
        message = senders.Message("failure", "host-a", {"key": "k", "outcome": "failed"})
        written = parse({"webhook": hook.url, "token_file": str(token)})
        from_file = parse({"webhook_file": str(url)})
        senders.send(written, message, sendmail="/nonexistent")
        senders.send(from_file, message, sendmail="/nonexistent")
        token.write_text("tok-2\n")  # read at each sending: no reload needed
        senders.send(written, message, sendmail="/nonexistent")
        assert hook.authorizations == ["Bearer tok-1", None, "Bearer tok-2"]
        assert [d["key"] for d in hook.docs] == ["k"] * 3
        # a file gone by the time of a sending is that sending's one-line error
        token.unlink()
        with pytest.raises(senders.SendError, match=r"^token_file: cannot read .*/token: "
                                                    r"No such file or directory$"):
            senders.send(written, message, sendmail="/nonexistent")
        # a URL file that holds no URL: its content is not printed
        url.write_text("not a url with a secret\n")
        with pytest.raises(senders.SendError) as err:
            senders.send(from_file, message, sendmail="/nonexistent")
        assert str(err.value).startswith("webhook_file: ") and "secret" not in str(err.value)
        assert len(hook.docs) == 3
    finally:
        hook.close()


@pytest.mark.parametrize(("spec", "error"), [
    ({"webhook": "http://h/", "webhook_file": "/x"},
     "webhook_file: the URL comes from webhook or from webhook_file, not both"),
    ({"mail": "ops", "token_file": "/x"}, "token_file: only for a webhook"),
    ({"webhook": "http://h/", "token_file": "rel/x"},
     "token_file: 'rel/x' is neither an absolute path nor a systemd credential name"),
    ({"webhook": "http://h/", "token": "inline"}, "token: unknown key"),
])
def test_bad_webhook_secret_keys_are_one_line(spec: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError) as err:
        parse(spec)
    assert str(err.value).startswith(error) and "\n" not in str(err.value)


def test_the_daemon_refuses_a_notifier_whose_secret_file_it_cannot_read(
        tmp_path: Path) -> None:
    """notify_refusal: what perfectschedd checks at start and on reload."""
    token = secret_file(tmp_path, "tok\n", name="token")
    config = from_mapping({**PG, "notifiers": {"ops": {"webhook": "http://h/",
                                                       "token_file": str(token)}}})
    assert notify_refusal(config) is None
    token.chmod(0o644)
    why = notify_refusal(config)
    assert why is not None and why.startswith("notifier ops: token_file: ") and \
        "readable by every user" in why
