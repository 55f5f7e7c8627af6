"""Apps for `vigil reload` tests, made from examples/hello/hello.py by one added line (a
SIGHUP handler; hello itself has none, so HUP would end it): one that reloads (RELOADING=1,
then READY=1 on $NOTIFY_SOCKET, and a line on stdout), one whose reload breaks it (it answers
500 from then on: a reload that never comes back ready).

The broken one answers 500 from the instant the signal is sent, not from when Python runs a
handler: a handler runs later, in the main thread, and a probe's thread could answer 200 in
between (8 of 30 probes right after the signal did, under a CPU hog; a reload judged fine
within 0.1 s failed tests/recovery's reload.ended). So SIGHUP is blocked in every thread and
stays pending, and each request reads the pending set."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HELLO

ANCHOR = "signal.signal(signal.SIGTERM, lambda *_: STOP.set())"
RELOADS = ('signal.signal(signal.SIGHUP, lambda *_: (notify("RELOADING=1"), '
           'print("reloaded", flush=True), notify("READY=1")))')
BREAKS = "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})  # before any thread"
HEALTH = "code = 500 if FAIL else 200"
BROKEN = "code = 500 if FAIL or signal.SIGHUP in signal.sigpending() else 200"


def _made(where: Path, name: str, line: str, *swaps: tuple[str, str]) -> Path:
    text = HELLO.read_text()
    assert ANCHOR in text, "hello.py no longer sets its SIGTERM handler as this expects"
    text = text.replace(ANCHOR, f"{ANCHOR}\n{line}", 1)
    for old, new in swaps:
        assert old in text, f"hello.py no longer has {old!r}"
        text = text.replace(old, new, 1)
    path = where / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def reloadable(where: Path) -> Path:
    return _made(where, "hello-reloads.py", RELOADS)


def breaks_on_reload(where: Path) -> Path:
    return _made(where, "hello-breaks.py", BREAKS, (HEALTH, BROKEN))
