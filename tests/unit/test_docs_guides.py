"""The guides can be followed in a row on one box (issue 39): no two of them (and the
getting-started page) add a host of the same name, so the second's `vigil host add` is not
refused because the first's host exists."""

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
