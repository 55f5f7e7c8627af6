"""Tables at 80 columns (issue 22): with long host names, a deep build path and a long
reason, every line of `vigil status`, `host list` and `obligations` fits; a long cell is
cut in the middle (`/very/lo…/build`), and only the last column wraps."""

from __future__ import annotations

import shutil
from pathlib import Path

from runners.cli.output import CELL_FLOOR, middle
from tests.conftest import FIXTURES, HELLO, Vigil, wait_for

NARROW = {"COLUMNS": "80"}
LONG = "a-rather-long-host-name-for-the-payments-api-eu1"  # 48 characters
BROKEN = "broken-" + "x" * 30


def lines_fit(text: str, width: int = 80) -> list[str]:
    lines = text.splitlines()
    assert lines, "nothing printed"
    wide = [line for line in lines if len(line) > width]
    assert not wide, "\n".join(wide)
    return lines


def test_tables_fit_80_columns(vigil: Vigil, short_tmp: Path) -> None:
    deep = short_tmp / "releases" / "2026-12-02T06-25-00Z-build-4711-abcdef" / "app" / "bin"
    deep.mkdir(parents=True)
    build = deep / "hello-server-with-a-long-file-name.py"
    shutil.copy(HELLO, build)
    vigil.add_host(LONG, build)
    vigil.add_host(BROKEN, FIXTURES / "exit_fast.py")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", LONG, "--wait")
    vigil.run("wake", BROKEN, "--wait", check=False)
    wait_for(lambda: vigil.status(BROKEN).get("problem"), 30, what="the broken host's problem")
    socket = vigil.status(LONG)["socket"]
    assert socket and len(socket) > 40, socket

    wide = vigil.run("status", env={"COLUMNS": "300"}).stdout
    assert socket in wide and vigil.status(BROKEN)["problem"] in wide  # all there, one line each
    digest = vigil.status(LONG)["build_digest"][:12]
    assert f"{digest} {build.name}" in wide, wide  # the build's file name beside its digest
    status = vigil.run("status", env=NARROW).stdout
    lines = lines_fit(status)
    assert all(h in status for h in ("host", "state", "socket")), status
    assert socket not in status and any(  # the socket cut in the middle: both its ends kept
        middle(socket, k) in line for line in lines for k in range(CELL_FLOOR, len(socket))), status
    row = next(line for line in lines if line.startswith(LONG[:5]))  # the host's own row
    assert "awake" in row and "…" in row, status  # its name cut, its state on the same line
    problem = vigil.status(BROKEN)["problem"]
    words = " ".join(line.strip() for line in lines)
    assert problem in words, status  # the last column wrapped, every word of it kept
    assert sum(line.startswith("host ") for line in lines) == 1, status  # one heading line
    body = lines[[line.startswith("host ") for line in lines].index(True) + 1:]
    assert all(line.startswith((LONG[:5], BROKEN[:5], " ")) for line in body), status
    # (no column but the last wrapped onto a line of its own)

    lines_fit(vigil.run("status", env={"COLUMNS": ""}).stdout)  # not a terminal: 80

    listing = vigil.run("host", "list", env=NARROW).stdout
    lines_fit(listing)
    digest = vigil.status(LONG)["build_digest"][:12]
    assert build.name[:16] in listing and digest in listing, listing  # the last column, wrapped
    vigil.run("stop", LONG, "--wait")
    obligations = vigil.run("obligations", env=NARROW).stdout
    lines_fit(obligations)
    vigil.quiesce(30)
    vigil.check()
