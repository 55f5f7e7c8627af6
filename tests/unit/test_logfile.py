"""Rotating, the log keeper's file (runners/keepers/logfile.py), against real pipes and
files: what it takes from a pipe is in the file once and in order, a rotation at the cap
cuts at a line end (tee shows the line end without taking the bytes), a line longer than
the cap starts a fresh file, and a file that cannot be written drops output rather than
blocking the app."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runners.keepers.logfile import Rotating, peek, waiting


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def take_all(out: Rotating, r: int) -> int:
    moved = 0
    while waiting(r):
        moved += out.take(r)
    return moved


def files_oldest_first(path: Path) -> list[bytes]:
    rotated = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:]))
    return [p.read_bytes() for p in [*rotated, path] if p.exists()]


def test_peek_leaves_the_bytes_in_the_pipe(pipe: tuple[int, int]) -> None:
    r, w = pipe
    os.write(w, b"one\ntwo\n")
    assert peek(r, 5) == b"one\nt"
    assert waiting(r) == 8 and os.read(r, 100) == b"one\ntwo\n"
    with pytest.raises(BlockingIOError):
        peek(r, 5)


def test_rotation_cuts_at_a_line_end(tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "g1.log"
    out = Rotating(str(log), 100, 50)
    sent = b"".join(b"line %03d %s\n" % (i, b"y" * (i % 23)) for i in range(200))
    for i in range(0, len(sent), 1000):  # lines cross the 1,000-byte writes
        os.write(w, sent[i:i + 1000])
        take_all(out, r)
    kept = files_oldest_first(log)
    assert b"".join(kept) == sent
    assert all(len(f) <= 100 and f.endswith(b"\n") for f in kept), [len(f) for f in kept]
    assert len(kept) > 40


def test_a_line_longer_than_the_cap_starts_a_fresh_file(tmp_path: Path,
                                                         pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "g1.log"
    out = Rotating(str(log), 10, 5)
    os.write(w, b"ab\n" + b"z" * 25 + b"\nc\n")
    take_all(out, r)
    assert files_oldest_first(log) == [b"ab\n", b"z" * 10, b"z" * 10, b"zzzzz\nc\n"]
    os.close(w)
    assert out.take(r) == 0  # every writer closed it: EOF


def test_reopened_it_appends_where_the_file_ends(tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "g1.log"
    first = Rotating(str(log), 1 << 20, 2)
    os.write(w, b"before\n")
    take_all(first, r)  # then the keeper dies: its successor opens the file again
    again = Rotating(str(log), 1 << 20, 2)
    os.write(w, b"after\n")
    take_all(again, r)
    assert log.read_bytes() == b"before\nafter\n"


def test_a_file_that_cannot_be_written_drops_output(tmp_path: Path,
                                                    pipe: tuple[int, int]) -> None:
    r, w = pipe
    d = tmp_path / "h"
    d.mkdir()
    out = Rotating(str(d / "g1.log"), 10, 2)
    os.write(w, b"123456789\n")
    take_all(out, r)
    for f in d.iterdir():  # the file and its times
        f.unlink()
    d.rmdir()  # the host's dir is gone: the rotation fails
    os.write(w, b"lost\n" * 100)
    assert take_all(out, r) == 500 and waiting(r) == 0  # drained: the app is not blocked


def records(path: Path) -> list[tuple[int, float]]:
    out = []
    for line in path.read_text().splitlines():
        end, at = line.split()
        out.append((int(end), float(at)))
    return out


def test_each_take_records_the_size_and_the_time_beside_the_file(
        tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "g1.log"
    out = Rotating(str(log), 1 << 20, 2, granule=0.0)  # a record for every take
    before = time.time()
    for text in (b"one\n", b"two\nthr", b"ee\n"):
        os.write(w, text)
        take_all(out, r)
    kept = records(tmp_path / "g1.times")
    assert [end for end, _ in kept] == [4, 11, 14] and log.stat().st_size == 14
    ats = [at for _, at in kept]
    assert before <= ats[0] <= ats[1] <= ats[2] <= time.time()


def test_the_times_rotate_with_their_file(tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "g1.log"
    out = Rotating(str(log), 10, 3, granule=0.0)
    for text in (b"aaaa\n", b"bbbb\n", b"cccc\n"):  # the third crosses the cap of 10
        os.write(w, text)
        take_all(out, r)
    assert (tmp_path / "g1.log.1").read_bytes() == b"aaaa\nbbbb\n"
    assert [end for end, _ in records(tmp_path / "g1.times.1")] == [5, 10]
    assert [end for end, _ in records(tmp_path / "g1.times")] == [5] and log.read_bytes() == b"cccc\n"


def test_a_times_file_naming_more_than_its_log_starts_afresh(tmp_path: Path,
                                                             pipe: tuple[int, int]) -> None:
    """A keeper killed between the two renames of a rotation leaves the old times under the
    new file's name: they are not the new file's."""
    r, w = pipe
    (tmp_path / "g1.log").write_bytes(b"x\n")
    (tmp_path / "g1.times").write_bytes(b"500 1.0\n900 2.0\n")
    out = Rotating(str(tmp_path / "g1.log"), 1 << 20, 2, granule=0.0)
    os.write(w, b"y\n")
    take_all(out, r)
    assert [end for end, _ in records(tmp_path / "g1.times")] == [2, 4]  # "x" at its mtime


def test_the_takes_of_one_granule_share_one_record(tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    out = Rotating(str(tmp_path / "g1.log"), 1 << 20, 2, granule=3600.0)
    for text in (b"one\n", b"two\n", b"three\n"):
        os.write(w, text)
        take_all(out, r)
    assert records(tmp_path / "g1.times") == []  # still pending: the lines read the mtime
    out.close()
    assert [end for end, _ in records(tmp_path / "g1.times")] == [14]


def test_a_new_keeper_records_what_the_killed_one_had_not(tmp_path: Path,
                                                          pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "g1.log"
    first = Rotating(str(log), 1 << 20, 2, granule=3600.0)
    os.write(w, b"before\n")
    take_all(first, r)  # its record pending when it is killed (never closed)
    os.utime(log, (1000.0, 1000.0))
    Rotating(str(log), 1 << 20, 2, granule=0.0)
    assert records(tmp_path / "g1.times") == [(7, 1000.0)]
