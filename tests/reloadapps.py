"""Apps for `vigil reload` tests, made from examples/hello/hello.py by one added line (a
SIGHUP handler; hello itself has none, so HUP would end it): one that reloads (RELOADING=1,
then READY=1 on $NOTIFY_SOCKET, and a line on stdout), one whose reload breaks it (it answers
500 from then on: a reload that never comes back ready)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HELLO

ANCHOR = "signal.signal(signal.SIGTERM, lambda *_: STOP.set())"
RELOADS = ('signal.signal(signal.SIGHUP, lambda *_: (notify("RELOADING=1"), '
           'print("reloaded", flush=True), notify("READY=1")))')
BREAKS = 'signal.signal(signal.SIGHUP, lambda *_: globals().update(FAIL=True))'


def _made(where: Path, name: str, line: str) -> Path:
    text = HELLO.read_text()
    assert ANCHOR in text, "hello.py no longer sets its SIGTERM handler as this expects"
    path = where / name
    path.write_text(text.replace(ANCHOR, f"{ANCHOR}\n{line}", 1))
    path.chmod(0o755)
    return path


def reloadable(where: Path) -> Path:
    return _made(where, "hello-reloads.py", RELOADS)


def breaks_on_reload(where: Path) -> Path:
    return _made(where, "hello-breaks.py", BREAKS)
