"""One generation's log file, written by the log keeper (runners/keepers/logkeeper.py)
from the app's pipe, capped and rotated, with no byte ever only in the keeper's memory.

Why splice(2): a keeper that read() then write() lost the chunk when killed between the two
(960 to 17,520 lines of 25,000 to 100,000 in 20 kill -9s). splice moves the bytes into the
file before it takes them out of the pipe (whose read end the agent holds too), so a byte is
always in exactly one of the two; the file's end is the only cursor, and a new keeper
appends exactly once and in order whatever the instant the last one died.

Rotation cuts at a line end: tee(2) (ctypes: os has no tee) copies up to the cap into a
scratch pipe to find the last newline; a line longer than the cap starts a fresh file and
is cut at the cap. The shift g.log -> g.log.1 ... is one rename at a time (a kill between
leaves a gap in the numbers, never two copies).

While no keeper runs the app's writes fill the pipe, then block (EAGAIN if non-blocking),
as under systemd's journal. Only a file that cannot be written (disk full, dir gone) drops
output: those bytes are read and discarded, so the app never waits on disk trouble.

Times: the bytes never pass through the keeper, so beside each file it keeps `g<N>.times`
(rotated with it), one `<end offset> <unix seconds>` record per GRANULE of splices; a line's
time is the first record reaching its end (runners/cli/loglines.py). Records are written
after the bytes, so none names an offset the log lacks; a successor writes a killed
keeper's missing record from the file's mtime, and a times file naming more than its log
(killed between a rotation's two renames) is started afresh.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import sys
import termios
import time
from collections.abc import Callable

CHUNK = 1 << 16  # at most this much per call: every pipe gets its turn
GRANULE = 0.01  # seconds of output one times record covers (a line's time is at most this late)


@functools.cache
def _tee() -> Callable[..., int]:
    """libc's tee(2), loaded at the first peek (a file near its cap): the agent, a standby and a
    keeper that never rotates do without ctypes (0.4 MB of each process)."""
    import ctypes

    tee = ctypes.CDLL(None, use_errno=True).tee
    tee.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint]
    tee.restype = ctypes.c_ssize_t
    return tee


def times_path(log_path: str) -> str:
    """The times file beside a log file: g5.log -> g5.times, g5.log.2 -> g5.times.2."""
    head, _, rotation = log_path.rpartition(".log")
    return f"{head}.times{rotation}"


def last_offset(times_fd: int) -> int:
    """The end offset of a times file's last whole record (0 when it has none)."""
    end = os.lseek(times_fd, 0, os.SEEK_END)
    tail = os.pread(times_fd, min(end, 64), max(0, end - 64)).split(b"\n")
    for record in reversed(tail[:-1]):  # a torn last record (no newline) is skipped
        try:
            return int(record.split()[0])
        except (ValueError, IndexError):
            continue
    return 0


def waiting(pipe: int) -> int:
    """How many bytes wait in the pipe (FIONREAD)."""
    got = fcntl.ioctl(pipe, termios.FIONREAD, b"\0\0\0\0")
    return int.from_bytes(got, sys.byteorder)


def peek(pipe: int, want: int) -> bytes:
    """Up to `want` of the bytes that wait in the pipe, left in it (tee into a scratch
    pipe, read from there). BlockingIOError when it is empty."""
    r, w = os.pipe()
    try:
        n = _tee()(pipe, w, want, os.SPLICE_F_NONBLOCK)
        if n < 0:
            import ctypes

            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        out = b""
        while len(out) < n:
            out += os.read(r, n - len(out))
        return out
    finally:
        os.close(r)
        os.close(w)


class Rotating:
    """One generation's file, rotated at `max_bytes` (cut at a line end when one fits)."""

    def __init__(self, path: str, max_bytes: int, files: int, granule: float = GRANULE) -> None:
        self.path, self.max_bytes, self.files = path, max_bytes, max(1, files)
        self.fd = self.times = -1
        self.size = 0
        self.granule = granule
        self.pending: tuple[int, float] | None = None  # (end offset, time) not yet written
        self.since = 0.0  # when the pending record's first splice was taken
        self._open()

    def _open(self) -> None:  # not O_APPEND: splice(2) refuses it; this is the only writer
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            self.times = os.open(times_path(self.path),
                                 os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            recorded = last_offset(self.times)
            if recorded > self.size:  # another file's times: start afresh
                os.ftruncate(self.times, 0)
                recorded = 0
            if self.size > recorded:  # a killed keeper's last record: its time is the mtime
                self.pending = (self.size, os.fstat(self.fd).st_mtime)
                self._write_pending()
        except OSError:  # the times are lost, never the output
            self.times = -1

    def park(self) -> None:
        """Its files closed while its pipe is quiet (the keeper holds a few open at once,
        not two for every app); the next take opens them again, at the file's end."""
        self.close()

    def close(self) -> None:
        self._write_pending()
        for fd in (self.fd, self.times):
            if fd >= 0:
                os.close(fd)
        self.fd = self.times = -1

    def _stamp(self) -> None:
        """The record of a take: the file's size now and the time (after the bytes). The
        takes of one granule share one record, the last one's, written when a take of a
        later granule comes (or at close): at most one record per granule of output."""
        now = time.time()
        if self.pending is None or now - self.since >= self.granule:
            self._write_pending()
            self.since = now
        self.pending = (self.size, now)
        if self.granule <= 0:
            self._write_pending()

    def _write_pending(self) -> None:
        if self.pending is not None and self.times >= 0:
            try:
                os.write(self.times, b"%d %.6f\n" % self.pending)
            except OSError:
                pass
        self.pending = None

    def _rotate(self) -> None:
        self.close()
        if self.files == 1:
            os.unlink(self.path)
            _unlink_quietly(times_path(self.path))
        else:
            for i in range(self.files - 1, 0, -1):  # .1 -> .2, ..., base -> .1
                src = self.path if i == 1 else f"{self.path}.{i - 1}"
                for a, b in ((times_path(src), times_path(f"{self.path}.{i}")),
                             (src, f"{self.path}.{i}")):  # the times first: see the top
                    try:
                        os.replace(a, b)
                    except FileNotFoundError:
                        pass
        self._open()

    def _count(self, pipe: int) -> int:
        """How much of the pipe goes into this file now (0: rotate first)."""
        room = self.max_bytes - self.size
        if room <= 0:
            return 0
        ready = waiting(pipe)
        if ready <= room or room >= CHUNK:  # nothing crosses the cap (1: to see EOF)
            return min(max(ready, 1), CHUNK, room)
        nl = peek(pipe, room).rfind(b"\n")
        if nl >= 0:
            return nl + 1
        if self.size > 0:  # the line starts in a fresh file
            return 0
        return room  # a line longer than the cap: cut at the cap

    def take(self, pipe: int) -> int:
        """Splice what waits in the pipe into the file, up to CHUNK, never past the cap: how
        many bytes (0: EOF); BlockingIOError when empty; OSError when the pipe fails, and
        EMFILE/ENFILE when its parked file cannot be opened again (nothing taken)."""
        if self.fd < 0:
            try:
                self._open()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    raise
                return self._copy(pipe, CHUNK)  # the dir is gone: this output is lost
        while True:
            count = self._count(pipe)
            if count:
                break
            try:
                self._rotate()
            except OSError:  # the dir is gone or full: this output is lost
                return self._copy(pipe, CHUNK)
        try:
            n = os.splice(pipe, self.fd, count, flags=os.SPLICE_F_NONBLOCK)
        except (BlockingIOError, InterruptedError):
            raise
        except OSError:  # no splice here (EINVAL), disk full, I/O error, no file
            return self._copy(pipe, count)
        self.size += n
        if n:
            self._stamp()
        return n

    def discard(self, pipe: int) -> int:
        """A chunk of the pipe read and dropped (no file can be opened for it)."""
        return self._copy(pipe, CHUNK)

    def _copy(self, pipe: int, count: int) -> int:
        """The way without splice: read, then write what the file takes; what it does
        not take is dropped (the app is never blocked on disk trouble). Counted as
        written, so a file that fails is rotated in time."""
        data = os.read(pipe, count)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            pass
        self.size += len(data)
        if data and not view:  # only bytes the file has get a time
            self._stamp()
        return len(data)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
