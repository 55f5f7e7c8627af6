"""`vigil logs -f` (runners/cli/loglines.py Following) goes on from exactly where the first
print stopped, across a rotation meanwhile, and reads a generation that print did not see
from its start, its rotated files first (issue 37 item 13)."""

from __future__ import annotations

import os
from pathlib import Path

from runners.cli.loglines import End, Following, merged


def lines(n: int, start: int = 0, tag: str = "l") -> bytes:
    return b"".join(b"%s%d\n" % (tag.encode(), i) for i in range(start, start + n))


def texts(f: Following) -> list[bytes]:
    return [line.text for line in f.lines()]


def test_follow_goes_on_where_the_print_stopped(tmp_path: Path) -> None:
    (tmp_path / "g1.log").write_bytes(lines(100) + b"half")  # a line still being written
    ends: dict[tuple[str, int], End] = {}
    printed = [line.text for line in merged([("h", tmp_path, [1])], 5, None, ends)]
    assert printed == [b"l95", b"l96", b"l97", b"l98", b"l99"]  # not the half line
    with open(tmp_path / "g1.log", "ab") as f:
        f.write(b" done\n" + lines(10, 100))  # written between the print and the follow
    follow = Following("h", tmp_path, 1, ends["h", 1])
    assert texts(follow) == [b"half done", *lines(10, 100).split()]
    follow.close()


def test_a_rotation_between_the_print_and_the_follow_loses_nothing(tmp_path: Path) -> None:
    (tmp_path / "g1.log").write_bytes(lines(20))
    ends: dict[tuple[str, int], End] = {}
    merged([("h", tmp_path, [1])], 5, None, ends)
    with open(tmp_path / "g1.log", "ab") as f:
        f.write(lines(3, 20))
    os.rename(tmp_path / "g1.log", tmp_path / "g1.log.1")  # the keeper's rotation
    (tmp_path / "g1.log").write_bytes(lines(4, 23))
    follow = Following("h", tmp_path, 1, ends["h", 1])
    assert texts(follow) == lines(7, 20).split()
    with open(tmp_path / "g1.log", "ab") as f:
        f.write(lines(2, 27))
    assert texts(follow) == lines(2, 27).split()
    follow.close()


def test_a_generation_the_print_did_not_see_is_read_from_its_start(tmp_path: Path) -> None:
    (tmp_path / "g1.log").write_bytes(lines(20))
    ends: dict[tuple[str, int], End] = {}
    merged([("h", tmp_path, [1])], 5, None, ends)
    # A restart meanwhile: g2 began, wrote past its cap once (rotated) and goes on.
    (tmp_path / "g2.log.1").write_bytes(lines(50, 0, "n"))
    (tmp_path / "g2.log").write_bytes(lines(10, 50, "n"))
    follow = Following("h", tmp_path, 2, ends.get(("h", 2)))
    assert texts(follow) == lines(60, 0, "n").split()
    follow.close()


def test_damaged_times_records_are_skipped_and_only_lf_ends_a_line(tmp_path: Path) -> None:
    from runners.cli.loglines import read_file

    (tmp_path / "g1.log").write_bytes(b"a\nb\rc\nd\r\n")
    (tmp_path / "g1.times").write_bytes(b"2 inf\n6 nan\n9 -1e11\n9 5.0\n")
    os.utime(tmp_path / "g1.log", (7.0, 7.0))
    assert read_file(tmp_path / "g1.log", None, None) == [(5.0, b"a"), (5.0, b"b\rc"),
                                                          (5.0, b"d")]
