"""The lines of the apps' output files, each with the time the log keeper took it from the
app's pipe: the records of `g<N>.times` beside each `g<N>.log` (runners/keepers/logfile.py
says how they are written). A line's time is that of the first record whose offset reaches
the line's end; a line no record reaches (written before its record, or before vigil kept
times) has the file's mtime. Read by `vigil logs` (runners/cli/logs.py), which merges the
lines of several generations and hosts by these times."""

from __future__ import annotations

import os
import re
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

BLOCK = 1 << 16
_ANY = re.compile(r"g(\d+)\.log(?:\.(\d+))?")


@dataclass(frozen=True)
class Line:
    at: float  # unix time it was taken from the app's pipe
    host: str
    gen: int
    text: bytes


def times_of(log: Path) -> Path:
    """g5.log -> g5.times, g5.log.2 -> g5.times.2 (the keeper's own rule)."""
    head, _, rotation = log.name.rpartition(".log")
    return log.with_name(f"{head}.times{rotation}")


class Times:
    """The records of one times file: end offsets rising, each with its time."""

    def __init__(self, path: Path, fallback: float) -> None:
        self.offsets: list[int] = []
        self.stamps: list[float] = []
        self.fallback = fallback
        self.read(path)

    def read(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except OSError:
            return
        self.add(data[: data.rfind(b"\n") + 1])

    def add(self, records: bytes) -> None:
        for record in records.splitlines():
            try:
                end, at = record.split()
                offset, stamp = int(end), float(at)
            except ValueError:
                continue  # torn by a killed keeper
            if not self.offsets or offset > self.offsets[-1]:
                self.offsets.append(offset)
                self.stamps.append(stamp)

    def at(self, end: int) -> float:
        i = bisect_left(self.offsets, end)
        if i < len(self.stamps):
            return self.stamps[i]
        # Not yet recorded: the mtime, never before the last record (the kernel's coarse
        # clock may set an mtime a few ms behind the keeper's time.time() of an earlier piece).
        return max(self.fallback, self.stamps[-1]) if self.stamps else self.fallback

    def start_of(self, since: float) -> int:
        """An offset at or before the first byte taken at or after `since`."""
        i = bisect_left(self.stamps, since)
        return self.offsets[i - 1] if i > 0 else 0


def files_of(directory: Path, n: int) -> list[Path]:
    """Generation n's files, oldest first (g<n>.log.2, g<n>.log.1, g<n>.log)."""
    rotated = []
    for name in os.listdir(directory):
        m = _ANY.fullmatch(name)
        if m and int(m[1]) == n and m[2] is not None:
            rotated.append((int(m[2]), directory / name))
    out = [p for _, p in sorted(rotated, reverse=True)]
    base = directory / f"g{n}.log"
    return [*out, base] if base.exists() else out


def tail_start(f: object, end: int, want: int) -> int:
    """Where the last `want` lines of an open file end at `end` begin, read backwards."""
    pos, newlines = end, 0
    while pos > 0:
        step = min(BLOCK, pos)
        f.seek(pos - step)  # type: ignore[attr-defined]
        block = f.read(step)  # type: ignore[attr-defined]
        ends = [i for i, c in enumerate(block) if c == 10]
        last = pos == end and block.endswith(b"\n")  # the file's own last newline ends a line
        for i in reversed(ends):
            if last:
                last = False
                continue
            newlines += 1
            if newlines == want:
                return pos - step + i + 1
        pos -= step
    return 0


def line_start(f: object, offset: int) -> int:
    """`offset` moved back to the start of the line it is inside."""
    pos = offset
    while pos > 0:
        step = min(BLOCK, pos)
        f.seek(pos - step)  # type: ignore[attr-defined]
        nl = f.read(step).rfind(b"\n")  # type: ignore[attr-defined]
        if nl >= 0:
            return pos - step + nl + 1
        pos -= step
    return 0


def read_file(path: Path, want: int | None, since: float | None) -> list[tuple[float, bytes]]:
    """The file's lines (the last `want`, or those taken at or after `since`) with times."""
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        st = os.fstat(f.fileno())
        if since is not None and st.st_mtime < since:
            return []  # nothing was written to it since
        times = Times(times_of(path), st.st_mtime)
        start = 0
        if since is not None:
            start = line_start(f, min(times.start_of(since), st.st_size))
        if want is not None:
            start = max(start, tail_start(f, st.st_size, want) if want else st.st_size)
        f.seek(start)
        data = f.read(st.st_size - start)
    out, pos = [], start
    for text in data.splitlines(keepends=True):
        pos += len(text)
        at = times.at(pos)
        if since is None or at >= since:
            out.append((at, text.rstrip(b"\r\n")))
    return out


def generation_lines(host: str, directory: Path, n: int, want: int | None,
                     since: float | None) -> list[Line]:
    """Generation n's lines, oldest first: its newest files back until `want` are found."""
    got: list[Line] = []
    for path in reversed(files_of(directory, n)):
        if want is not None and len(got) >= want:
            break
        more = want - len(got) if want is not None else None
        got = [Line(at, host, n, text) for at, text in read_file(path, more, since)] + got
    return got


def merged(sources: list[tuple[str, Path, list[int]]], want: int | None,
           since: float | None) -> list[Line]:
    """The lines of every (host, its log dir, generations) by time, the last `want`."""
    lines: list[Line] = []
    for host, directory, gens in sources:
        for n in gens:
            lines += generation_lines(host, directory, n, want, since)
    lines.sort(key=lambda line: line.at)  # stable: a generation's own order is kept
    return lines[-want:] if want else ([] if want == 0 else lines)


class Following:
    """One generation's newest file read as it grows (`vigil logs --follow`), across its
    rotations, each line with its time (the time it is read, when its record is not yet
    written)."""

    def __init__(self, host: str, directory: Path, n: int, at_end: bool) -> None:
        self.host, self.directory, self.n = host, directory, n
        self.f: object | None = None
        self.times_f: object | None = None
        self.partial = b""
        self.pos = 0
        self._open(at_end)

    def _open(self, at_end: bool) -> None:
        path = self.directory / f"g{self.n}.log"
        try:
            self.f = open(path, "rb")
        except FileNotFoundError:
            self.f = None
            return
        self.inode = os.fstat(self.f.fileno()).st_ino
        self.pos = self.f.seek(0, os.SEEK_END) if at_end else 0
        self.times = Times(Path(os.devnull), 0.0)
        self.records = b""
        try:
            self.times_f = open(times_of(path), "rb")
        except FileNotFoundError:
            self.times_f = None

    def lines(self) -> list[Line]:
        """What was appended since the last call: across a rotation, the rest of the old
        file (the keeper writes no more to it once it is renamed), then the new one's."""
        if self.f is None:
            self._open(at_end=False)
            if self.f is None:
                return []
        out = self._read()
        try:
            rotated = os.stat(self.directory / f"g{self.n}.log").st_ino != self.inode
        except FileNotFoundError:
            rotated = False
        if rotated:
            out += self._read()
            self.close()
            self._open(at_end=False)
            self.pos = -len(self.partial)  # a line cut at the cap goes on in the new file
            out += self._read()
        return out

    def _read(self) -> list[Line]:
        if self.f is None:
            return []
        data = self.partial + self.f.read()  # type: ignore[attr-defined]
        *done, self.partial = data.split(b"\n")
        if self.times_f is not None:
            records = self.records + self.times_f.read()  # type: ignore[attr-defined]
            whole = records.rfind(b"\n") + 1  # a record being written waits for its end
            self.times.add(records[:whole])
            self.records = records[whole:]
        now, out = time.time(), []
        for text in done:
            self.pos += len(text) + 1
            recorded = bool(self.times.offsets) and self.pos <= self.times.offsets[-1]
            out.append(Line(self.times.at(self.pos) if recorded else now, self.host, self.n,
                            text))
        return out

    def close(self) -> None:
        for f in (self.f, self.times_f):
            if f is not None:
                f.close()  # type: ignore[attr-defined]
        self.f = self.times_f = None
