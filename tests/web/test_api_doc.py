"""docs/api.md and the API's routes are one list (as tests/test_docs.py holds the man
pages to the commands): every route has its heading, every heading a route, and every
error status the listener can answer is in the table of errors."""

from __future__ import annotations

import re
from pathlib import Path

from perfectschedd.control import protocol
from perfectschedd.web import api

DOC = Path(__file__).parent.parent.parent / "docs" / "api.md"


def test_every_route_has_its_heading_and_every_heading_a_route() -> None:
    text = DOC.read_text()
    documented = set(re.findall(r"^### `([A-Z]+) (/api/v1/[^`]*)`", text, re.M))
    routes = {(method, api.PREFIX + "/".join(pattern)) for method, pattern, _ in api.ROUTES}
    assert routes - documented == set(), "routes without a heading in docs/api.md"
    assert documented - routes == set(), "docs/api.md describes routes that do not exist"


def test_every_status_is_in_the_table_of_errors() -> None:
    text = DOC.read_text().split("## Errors", 1)[1].split("## Routes", 1)[0]
    listed = {int(s) for s in re.findall(r"^\| (\d{3}) \|", text, re.M)}
    statuses = {r.http_status for r in protocol.REFUSALS.values()}
    source = (Path(api.__file__).parent / "server.py").read_text() + \
        (Path(api.__file__).parent / "app.py").read_text()
    statuses |= {int(s) for s in re.findall(r"_(?:error|Refused)\((\d{3})", source)}
    statuses |= {401, 429, 405}  # credentials.py's and app.py's own
    assert statuses - listed == set(), "statuses missing from docs/api.md's errors"
