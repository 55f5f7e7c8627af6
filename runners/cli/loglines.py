"""The lines of the apps' output files, each with the time the log keeper took it from the
pipe, from `g<N>.times` beside each `g<N>.log` (runners/keepers/logfile.py): the first
record reaching a line's end; a line none reaches has the file's mtime. Read by `vigil
logs` (runners/cli/logs.py) to merge several generations and hosts."""

from __future__ import annotations

import os
import re
import time
from bisect import bisect_left
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from runners.keepers.logfile import times_path

BLOCK = 1 << 16
LAST_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last time a datetime can show
_ANY = re.compile(r"g(\d+)\.log(?:\.(\d+))?")


@dataclass(frozen=True)
class Line:
    at: float  # unix time it was taken from the app's pipe
    host: str
    gen: int
    text: bytes


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
            if not 0.0 <= stamp <= LAST_TIME:
                continue  # inf, nan, before 1970 or past 9999: damaged, never the keeper's
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


End = tuple[int, int]  # (inode, offset): where a print of a file stopped, for --follow


def read_file(path: Path, want: int | None, since: float | None,
              ends: dict[Path, End] | None = None) -> list[tuple[float, bytes]]:
    """The file's lines (the last `want`, or those taken at or after `since`) with times.
    `ends` (for --follow) gets where the read stopped: the end of its last whole line, so
    a follow goes on from exactly there (a line still being written is printed whole by it)."""
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        st = os.fstat(f.fileno())
        size = st.st_size
        if ends is not None:
            size = line_start(f, size)  # a line not yet ended is the follow's
            ends[path] = (st.st_ino, size)
        if since is not None and st.st_mtime < since:
            return []  # nothing was written to it since
        times = Times(Path(times_path(str(path))), st.st_mtime)
        start = 0
        if since is not None:
            start = line_start(f, min(times.start_of(since), size))
        if want is not None:
            start = max(start, tail_start(f, size, want) if want else size)
        f.seek(start)
        data = f.read(size - start)
    out, pos = [], start
    for text in split_lines(data):
        pos += len(text)
        at = times.at(pos)
        if since is None or at >= since:
            out.append((at, line_text(text)))
    return out


def split_lines(data: bytes) -> list[bytes]:
    """The lines of `data`, each with its LF: only LF ends a line (a lone CR is text, as
    --follow reads it; bytes.splitlines would split at it)."""
    out = [line + b"\n" for line in data.split(b"\n")]
    out[-1] = out[-1][:-1]
    return out if out[-1] else out[:-1]


def line_text(line: bytes) -> bytes:
    """A line as shown: without its LF, nor the CR of a CRLF."""
    return line.removesuffix(b"\n").removesuffix(b"\r")


def generation_lines(host: str, directory: Path, n: int, want: int | None,
                     since: float | None, ends: dict[tuple[str, int], End] | None = None
                     ) -> list[Line]:
    """Generation n's lines, oldest first: its newest files back until `want` are found.
    `ends` (for --follow) gets where the read of its newest file stopped."""
    got: list[Line] = []
    files = files_of(directory, n)
    read: dict[Path, End] | None = {} if ends is not None else None
    for path in reversed(files):
        if want is not None and len(got) >= want:
            break
        more = want - len(got) if want is not None else None
        got = [Line(at, host, n, text) for at, text in read_file(path, more, since, read)] + got
    if ends is not None and files:
        newest = files[-1]
        if read and newest in read:
            ends[host, n] = read[newest]
        else:  # none read (-n 0): as it is now
            with suppress(OSError):
                with open(newest, "rb") as f:
                    ends[host, n] = (os.fstat(f.fileno()).st_ino,
                                     line_start(f, os.fstat(f.fileno()).st_size))
    return got


def merged(sources: list[tuple[str, Path, list[int]]], want: int | None,
           since: float | None, ends: dict[tuple[str, int], End] | None = None) -> list[Line]:
    """The lines of every (host, its log dir, generations) by time, the last `want`;
    `ends` (for --follow) gets where each generation's print stopped."""
    lines: list[Line] = []
    for host, directory, gens in sources:
        for n in gens:
            lines += generation_lines(host, directory, n, want, since, ends)
    lines.sort(key=lambda line: line.at)  # stable: a generation's own order is kept
    return lines[-want:] if want else ([] if want == 0 else lines)


class Following:
    """One generation's files read as they grow (`vigil logs --follow`), across rotations,
    each line with its time (when read, if not yet recorded), from `start` (inode and offset
    where the first print stopped) or else the start of its oldest file."""

    def __init__(self, host: str, directory: Path, n: int, start: End | None) -> None:
        self.host, self.directory, self.n = host, directory, n
        self.f: object | None = None
        self.times_f: object | None = None
        self.inode: int | None = None  # of the file being read
        self.start = start
        self.partial = b""
        self.pos = 0
        self._open_next()

    def _open_next(self) -> bool:
        """Open the file after the one read (by inode: a rotation renames it), else the
        start's file at its offset, else the oldest; False: none there (yet)."""
        files = []
        for path in files_of(self.directory, self.n):
            with suppress(FileNotFoundError):
                files.append((path, os.stat(path).st_ino))
        inodes = [ino for _, ino in files]
        i, offset = 0, 0  # the oldest file kept: the one read or the start's was removed
        if self.inode is not None:
            i = inodes.index(self.inode) + 1 if self.inode in inodes else 0
        elif self.start is not None and self.start[0] in inodes:
            i, offset = inodes.index(self.start[0]), self.start[1]
        if i >= len(files):
            return False
        path = files[i][0]
        try:
            self.f = open(path, "rb")
        except FileNotFoundError:
            return False
        self.inode = os.fstat(self.f.fileno()).st_ino
        self.pos = self.f.seek(offset) - len(self.partial)  # a line cut at the cap goes on here
        self.times = Times(Path(os.devnull), 0.0)
        self.records = b""
        try:
            self.times_f = open(times_path(str(path)), "rb")
        except FileNotFoundError:
            self.times_f = None
        return True

    def lines(self) -> list[Line]:
        """What was appended since the last call: across a rotation, the rest of the file
        read (the keeper writes no more to it once it is renamed), then the next one's."""
        if self.f is None and not self._open_next():
            return []
        out = self._read()
        while self._rotated():
            out += self._read()
            self.close()
            if not self._open_next():
                break  # the next file is not there yet: opened at the next call
            out += self._read()
        return out

    def _rotated(self) -> bool:
        """The file being read is no longer the generation's newest."""
        try:
            return os.stat(self.directory / f"g{self.n}.log").st_ino != self.inode
        except FileNotFoundError:
            return False

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
                            line_text(text)))
        return out

    def close(self) -> None:
        for f in (self.f, self.times_f):
            if f is not None:
                f.close()  # type: ignore[attr-defined]
        self.f = self.times_f = None
