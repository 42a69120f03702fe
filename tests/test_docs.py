"""The man pages cannot drift from the code: perfectschedctl(1) has an entry for every
command of the command registry (control/registry.COMMANDS, the CLI's) and, inside it,
for every option of that command, and for every global option of the parser;
perfectschedd(8) has an entry for every configuration key (config.py's list).  Read from
the code, so that commands, options and keys added later are caught.  The pages are also
held to groff's warnings (lintian runs the same check on the package).  Every module
path the Markdown pages name (perfectschedd/..., perfectschedctl/...) exists."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from perfectschedctl import cli
from perfectschedd import config
from perfectschedd.control import registry
from perfectschedd.settings.routes import ROUTE_KEYS

ROOT = Path(__file__).resolve().parent.parent
MAN = ROOT / "docs" / "man"
MODULE_PATH = re.compile(r"\bperfectsched(?:d|ctl)/[\w/]*\.py\b")
CTL_PAGE = MAN / "perfectschedctl.1"
DAEMON_PAGE = MAN / "perfectschedd.8"
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def plain(line: str) -> str:
    """A roff line as read: no request, font escapes, quotes; \\- as -."""
    line = re.sub(r"^\.[A-Z]{1,2}\s*", "", line)
    line = re.sub(r"\\f[BIRP]", "", line).replace("\\-", "-").replace('"', "")
    return line.replace("\\(aq", "'").replace("\\(dq", '"')


def sections(text: str, request: str) -> dict[str, str]:
    """The text under each `request` heading (.SH or .SS), by the heading as read."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith(f"{request} "):
            name = plain(line).strip()
            out[name] = ""
        elif request == ".SS" and line.startswith(".SH "):
            name = None
        elif name is not None:
            out[name] += line + "\n"
    return out


def tags(body: str) -> list[str]:
    """The tag lines of a section's entries (the line after each .TP), as read."""
    lines = body.splitlines()
    return [plain(lines[i + 1]) for i, line in enumerate(lines[:-1]) if line == ".TP"]


def tagged_flags(body: str) -> set[str]:
    return {f for tag in tags(body) for f in FLAG.findall(tag)}


def command_entries(text: str) -> dict[str, tuple[str, str]]:
    """Each command's entry of COMMANDS: name -> (its heading, its text)."""
    commands = sections(text, ".SH")["COMMANDS"]
    return {heading.split()[0]: (heading, body)
            for heading, body in sections(commands, ".SS").items()
            if heading[:1].islower()}


def cli_commands() -> list[registry.Command]:
    return [c for c in registry.COMMANDS.values() if c.in_cli]


def test_every_command_has_an_entry() -> None:
    entries = command_entries(CTL_PAGE.read_text())
    names = {c.name for c in cli_commands()}
    assert sorted(names - set(entries)) == [], "commands missing from perfectschedctl(1)"
    assert sorted(set(entries) - names) == [], "perfectschedctl(1) documents commands " \
        "that do not exist"


@pytest.mark.parametrize("command", [c.name for c in cli_commands()])
def test_every_option_of_a_command_has_an_entry(command: str) -> None:
    entries = command_entries(CTL_PAGE.read_text())
    heading, body = entries.get(command, ("", ""))
    cmd = registry.COMMANDS[command]
    documented = tagged_flags(body)
    missing = [f for a in cmd.cli if not a.positional for f in a.flags
               if f not in documented]
    assert missing == [], f"options of {command} missing from its entry in " \
        "perfectschedctl(1)"
    # positionals are named in the heading, as the usage line names them
    words = set(re.findall(r"[A-Za-z|-]+", heading))
    named = [a.metavar or a.dest.upper() for a in cmd.cli if a.positional]
    assert [n for n in named if not set(re.findall(r"[A-Za-z|-]+", n)) <= words] == [], \
        heading
    # and nothing is documented that the command does not take
    takes = {f for a in cmd.cli for f in a.flags} | {"--json", "-h", "--help"}
    assert sorted(documented - takes) == [], f"{command}: documented, not taken"


def test_every_global_option_has_an_entry() -> None:
    options = sections(CTL_PAGE.read_text(), ".SH")["OPTIONS"]
    documented = tagged_flags(options)
    parser = cli.build_parser()
    flags = {f for action in parser._actions for f in action.option_strings} - {
        "-h", "--help"}
    assert sorted(flags - documented) == []


def test_every_config_key_has_an_entry() -> None:
    body = sections(DAEMON_PAGE.read_text(), ".SH")["CONFIGURATION"]
    documented = {t.split()[0] for t in tags(body) if t.split()}
    # config._KNOWN_KEYS: the keys the daemon accepts (anything else is refused).
    assert sorted(set(config._KNOWN_KEYS) - documented) == [], \
        "configuration keys missing from perfectschedd(8)"


def test_every_route_key_has_an_entry() -> None:
    body = sections(DAEMON_PAGE.read_text(), ".SH")["CONFIGURATION"]
    routes = body.split(".TP\n.B routes\n", 1)[1].split(".RE\n", 1)[0]
    documented = {t.split()[0] for t in tags(routes) if t.split()}
    # ROUTE_KEYS: the keys a route may have (anything else is refused).
    assert sorted(set(ROUTE_KEYS) - documented) == [], \
        "route keys missing from the routes entry of perfectschedd(8)"


def test_the_checks_see_an_entry_removed() -> None:
    """What the tests above read, with one entry taken out, misses it."""
    text = CTL_PAGE.read_text()
    entry = '.TP\n.B \\-\\-skip\\-missed\n'
    assert entry in text
    assert "--skip-missed" in tagged_flags(command_entries(text)["resume"][1])
    cut = command_entries(text.replace(entry, ".PP\n"))
    assert "--skip-missed" not in tagged_flags(cut["resume"][1])
    assert "init" not in command_entries(text.replace('.SS "init"\n', ""))
    daemon = DAEMON_PAGE.read_text()
    body = sections(daemon.replace(".TP\n.B retry_wait_max\n", ""), ".SH")["CONFIGURATION"]
    assert "retry_wait_max" not in {t.split()[0] for t in tags(body) if t.split()}


def test_what_the_issue_found_missing_is_documented() -> None:
    ctl, daemon = CTL_PAGE.read_text(), DAEMON_PAGE.read_text()
    for word in ("@once", "--misfire", "--grace", "--max-attempts", "--retry-wait",
                 "--jitter", "--timeout"):
        assert word in plain(ctl), word
    for word in ("retry_wait_max", "SCHED_DONE", "SCHED_FAIL", "SCHED_LATER",
                 "PERFECTSCHED_RUN_ID"):
        assert word in plain(daemon), word


def examples() -> list[list[str]]:
    """The argument vectors of the perfectschedctl lines of EXAMPLES, as a shell reads
    them."""
    text = sections(CTL_PAGE.read_text(), ".SH")["EXAMPLES"]
    return [shlex.split(line.replace("\\-", "-").replace("\\(aq", "'"))[1:]
            for line in text.splitlines() if line.startswith("perfectschedctl ")]


def test_the_examples_are_found() -> None:
    assert len(examples()) >= 3


@pytest.mark.parametrize("argv", examples(), ids=lambda a: " ".join(a[:2]))
def test_each_example_parses_as_shown(argv: list[str]) -> None:
    cli.request_of(cli.build_parser().parse_args(argv))


@pytest.mark.parametrize("page", [CTL_PAGE, DAEMON_PAGE, MAN / "perfectsched-grant.8"],
                         ids=lambda p: p.name)
def test_groff_has_no_warnings(page: Path) -> None:
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed")
    res = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True,
                         text=True, timeout=60)
    assert (res.returncode, res.stderr) == (0, "")


def test_the_daemon_example_is_a_configuration_it_takes(tmp_path: Path) -> None:
    text = sections(DAEMON_PAGE.read_text(), ".SH")["EXAMPLES"]
    body = text.split(".nf\n", 1)[1].split(".fi\n", 1)[0]
    path = tmp_path / "perfectsched.yml"
    # its password_file, here
    secret = tmp_path / "dbpass"
    secret.write_text("pw\n")
    secret.chmod(0o640)
    path.write_text(body.replace("\\-", "-").replace("/etc/perfectsched/dbpass", str(secret)))
    loaded = config.load(str(path))
    assert [r.pattern for r in loaded.routes] == ["backup", "/^report-.*$/"]
    assert loaded.url == "postgresql://sched:pw@db.example.com/sched"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_the_module_paths_a_page_names_exist(page: Path) -> None:
    named = set(MODULE_PATH.findall(page.read_text()))
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []


def test_the_module_path_check_sees_one_named() -> None:
    assert MODULE_PATH.findall("in `perfectschedd/control/protocol.py` (framing)") == [
        "perfectschedd/control/protocol.py"]
    assert MODULE_PATH.findall((ROOT / "docs" / "protocol.md").read_text())
