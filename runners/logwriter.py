"""One generation's output writer: reads the app's stdout and stderr (one pipe) and appends
them to `<state>/logs/<host>/g<N>.log`, rotated at a size cap: at most FILES files of at
most MAX_BYTES each (g<N>.log, g<N>.log.1, ...; the oldest is dropped), so a chatty app
cannot fill the disk. Older generations' files beyond the newest KEEP generations of the
host are deleted when it starts.

It runs as its own small process (`python -S -I logwriter.py ...`, the standard library
only), outside the generation's containment: it is not one of the app's processes, it
outlives the agent (apps keep running when the agent stops or dies, and so does their
output), and it ends by itself once every process of the generation has closed its end of
the pipe. It never blocks the app: a write that fails (disk full) drops that output."""

from __future__ import annotations

import os
import re
import signal
import sys

KEEP = 5  # generations' files kept per host
CHUNK = 1 << 16
_FILE = re.compile(r"g(\d+)\.log(?:\.\d+)?")


def prune(directory: str, keep: int = KEEP) -> None:
    """Delete the files of all but the newest `keep` generations in a host's log dir."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    gens = sorted({int(m[1]) for n in names if (m := _FILE.fullmatch(n))}, reverse=True)
    old = set(gens[keep:])
    for n in names:
        m = _FILE.fullmatch(n)
        if m and int(m[1]) in old:
            try:
                os.unlink(os.path.join(directory, n))
            except OSError:
                pass


class Rotating:
    def __init__(self, path: str, max_bytes: int, files: int) -> None:
        self.path, self.max_bytes, self.files = path, max_bytes, max(1, files)
        self.fd = -1
        self.size = 0
        self._open()

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size

    def _rotate(self) -> None:
        os.close(self.fd)
        if self.files == 1:
            os.unlink(self.path)
        else:
            for i in range(self.files - 1, 0, -1):  # .1 -> .2, ..., base -> .1
                src = self.path if i == 1 else f"{self.path}.{i - 1}"
                try:
                    os.replace(src, f"{self.path}.{i}")
                except FileNotFoundError:
                    pass
        self._open()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            room = self.max_bytes - self.size
            if room <= 0:
                self._rotate()
                continue
            part = view[:room]
            if len(view) > room:  # cut at the last whole line that fits, if any
                nl = bytes(part).rfind(b"\n")
                if nl >= 0:
                    part = part[:nl + 1]
                elif self.size > 0:
                    self.size = self.max_bytes  # start the line in a fresh file
                    continue
            try:
                n = os.write(self.fd, part)
            except OSError:  # disk full, I/O error: this output is lost, the app goes on
                n = len(part)
            self.size += n
            view = view[n:]


def main(argv: list[str]) -> int:
    path, max_bytes, files = argv[0], int(argv[1]), int(argv[2])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # it ends at EOF, not with a session's signals
    out = Rotating(path, max_bytes, files)
    prune(os.path.dirname(path))
    while True:
        try:
            data = os.read(0, CHUNK)
        except InterruptedError:
            continue
        if not data:
            return 0
        out.write(data)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
