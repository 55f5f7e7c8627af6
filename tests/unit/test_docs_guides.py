"""The guides can be followed in a row on one box (issue 39): no two of them (and the
getting-started page) add a host of the same name, or two hosts on one loopback address, so
a later `vigil host add` is not refused because an earlier host or listener exists."""

from __future__ import annotations

import re
from collections import defaultdict

from tests.conftest import ROOT

ADD = re.compile(r"vigil (?:--db \S+ )?host add ([a-z0-9][a-z0-9-]*)(?![A-Za-z0-9_-])")


def guides() -> list[str]:
    docs = ROOT / "docs"
    return ["getting-started.md"] + sorted(f"guides/{p.name}" for p in (docs / "guides").glob("*.md"))


def test_the_guides_add_hosts_of_distinct_names() -> None:
    adds: dict[str, set[str]] = defaultdict(set)
    for page in guides():
        for name in ADD.findall((ROOT / "docs" / page).read_text()):
            adds[name].add(page)
    assert len(adds) >= 5, dict(adds)  # the pattern finds them
    shared = {name: sorted(pages) for name, pages in adds.items() if len(pages) > 1}
    assert not shared, f"host names added by more than one guide: {shared}"


LOOPBACK = re.compile(r"tcp:(127\.0\.0\.1:[0-9]+)")


def test_the_guides_hosts_listen_on_distinct_loopback_addresses() -> None:
    """Each `vigil host add` (its continued lines joined) and the addresses it listens on;
    0.0.0.0 is left out: listeners.md shows a refused twin on purpose (several boxes)."""
    names: dict[str, set[str]] = defaultdict(set)
    for page in guides():
        text = (ROOT / "docs" / page).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            added = ADD.search(line)
            if added is not None:
                for address in LOOPBACK.findall(line):
                    names[address].add(f"{added.group(1)} ({page})")
    assert names, "the pattern finds them"
    shared = {a: sorted(n) for a, n in names.items() if len({x.split()[0] for x in n}) > 1}
    assert not shared, f"one loopback address for several hosts: {shared}"
