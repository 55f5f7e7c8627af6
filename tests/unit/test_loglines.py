"""The reader of the apps' output files with their times (runners/cli/loglines.py), on
files written as the log keeper writes them: a line's time is its first record's, the
last lines and the lines since a time are found without reading the rest, and several
hosts' lines merge by time with each generation's own order kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runners.cli.loglines import Times, line_start, merged, read_file, tail_start


def write(directory: Path, name: str, pieces: list[tuple[bytes, float]]) -> Path:
    """A log file and its times, one record per piece (as one splice each)."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / name
    head, _, rotation = name.rpartition(".log")
    data, records = b"", []
    for piece, at in pieces:
        data += piece
        records.append(b"%d %.6f\n" % (len(data), at))
    log.write_bytes(data)
    (directory / f"{head}.times{rotation}").write_bytes(b"".join(records))
    os.utime(log, (2000.0, 2000.0))
    return log


def test_a_line_has_the_time_of_the_record_that_reaches_its_end(tmp_path: Path) -> None:
    log = write(tmp_path, "g1.log", [(b"a\nb", 10.0), (b"b\nc\n", 20.0), (b"d\n", 30.0)])
    assert read_file(log, None, None) == [(10.0, b"a"), (20.0, b"bb"), (20.0, b"c"), (30.0, b"d")]
    with open(log, "ab") as f:
        f.write(b"not yet recorded\n")  # the keeper was killed before its record
    assert read_file(log, None, None)[-1] == (os.stat(log).st_mtime, b"not yet recorded")


def test_torn_and_stale_records_are_skipped(tmp_path: Path) -> None:
    times = tmp_path / "g1.times"
    times.write_bytes(b"4 1.0\ngarbage\n2 0.5\n9 3.0\n12 4")
    t = Times(times, 99.0)
    assert (t.offsets, t.stamps) == ([4, 9], [1.0, 3.0])
    assert (t.at(3), t.at(4), t.at(5), t.at(10)) == (1.0, 1.0, 3.0, 99.0)
    # an mtime behind the last record (the kernel's coarse clock): never before that record
    assert Times(times, 2.0).at(10) == 3.0


@pytest.mark.parametrize("want", [0, 1, 2, 5, 50])
def test_the_last_lines_are_found_from_the_end(tmp_path: Path, want: int) -> None:
    lines = [b"line %d %s" % (i, b"x" * (i * 997 % 70_000)) for i in range(12)]
    log = write(tmp_path, "g1.log", [(b"\n".join(lines) + b"\n", 5.0)])
    if want:
        with open(log, "rb") as f:
            start = tail_start(f, log.stat().st_size, want)
            assert line_start(f, start + 3) == start  # inside the line it starts
    assert [t for _, t in read_file(log, want, None)] == (lines[-want:] if want else [])


def test_the_lines_since_a_time_are_read_from_its_record(tmp_path: Path) -> None:
    log = write(tmp_path, "g1.log", [(b"old 1\nold 2\nnew", 10.0), (b" 1\nnew 2\n", 20.0),
                                     (b"new 3\n", 30.0)])
    assert [t for _, t in read_file(log, None, 15.0)] == [b"new 1", b"new 2", b"new 3"]
    assert [t for _, t in read_file(log, 1, 15.0)] == [b"new 3"]
    os.utime(log, (12.0, 12.0))
    assert read_file(log, None, 15.0) == []  # not written to since: not read


def test_hosts_and_generations_merge_by_time(tmp_path: Path) -> None:
    web, api = tmp_path / "web", tmp_path / "api"
    write(web, "g1.log.1", [(b"w1 a\n", 1.0), (b"w1 b\n", 4.0)])
    write(web, "g1.log", [(b"w1 c\n", 6.0)])
    write(web, "g2.log", [(b"w2 a\n", 5.0), (b"w2 b\n", 6.0)])  # an overlap: both ran
    write(api, "g7.log", [(b"a7 a\n", 2.0), (b"a7 b\n", 6.0)])
    sources = [("web", web, [1, 2]), ("api", api, [7])]
    got = merged(sources, None, None)
    assert [line.text for line in got] == [b"w1 a", b"a7 a", b"w1 b", b"w2 a", b"w1 c",
                                          b"w2 b", b"a7 b"]
    assert [(line.host, line.gen) for line in got[:2]] == [("web", 1), ("api", 7)]
    assert [line.text for line in merged(sources, 2, None)] == [b"w2 b", b"a7 b"]
    assert [line.text for line in merged(sources, None, 5.5)] == [b"w1 c", b"w2 b", b"a7 b"]
