"""The documentation keeps up with the code: the generated pages (CLI reference, state
diagrams, crash points) equal what runners/cli/docs.py writes now, the README stays a
landing page whose docs/ links all exist, and the hosts-file page names every key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runners.cli import docs

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
HEADING = re.compile(r"^#+ (.+)$", re.M)


@pytest.mark.parametrize("path", sorted(docs.FILES))
def test_generated_page_is_current(path: str) -> None:
    file = ROOT / path
    assert file.exists(), f"{path} is missing: run `{docs.COMMAND}`"
    assert file.read_text() == docs.expected(path), (
        f"{path} differs from the code: run `{docs.COMMAND}` and commit the result")


def test_every_state_machine_has_a_diagram() -> None:
    from models.states import TRANSITIONS

    text = (ROOT / "docs/concepts.md").read_text()
    for machine, moves in TRANSITIONS.items():
        assert f"### {machine.__name__} (" in text, machine
        for old, targets in moves.items():
            for new in targets:
                assert f"    {old.name} --> {new.name}\n" in text, (machine, old, new)


def test_every_command_is_in_the_cli_reference() -> None:
    text = (ROOT / "docs/reference/cli.md").read_text()
    for name in ("vigil host add", "vigil rollout start", "vigil agent start", "vigil db upgrade"):
        assert f"\n## {name}\n" in text, name


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def links(page: Path) -> list[tuple[str, str | None]]:
    """(path, anchor) of every relative link on the page; path "" is the page itself."""
    return [(m.group(1), m.group(2)) for m in LINK.finditer(page.read_text())
            if not m.group(1).startswith(("http://", "https://", "mailto:"))]


def broken(page: Path) -> list[str]:
    """Links to a file that does not exist, or to a heading its target does not have."""
    bad = []
    for target, anchor in links(page):
        file = page.parent / target if target else page
        if not file.exists():
            bad.append(f"{page.relative_to(ROOT)} -> {target}")
        elif anchor and file.suffix == ".md":
            anchors = {docs._anchor(h) for h in HEADING.findall(file.read_text())}
            if anchor not in anchors:
                bad.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    return bad


def test_readme_links_exist() -> None:
    assert any(t.startswith("docs/") for t, _ in links(ROOT / "README.md"))
    missing = broken(ROOT / "README.md")
    assert not missing, f"README.md links to missing files or headings: {missing}"


def test_links_inside_docs_exist() -> None:
    missing = [b for page in sorted((ROOT / "docs").rglob("*.md")) for b in broken(page)]
    assert not missing, f"broken links: {missing}"


def test_hosts_file_page_names_every_key() -> None:
    from runners.cli import hostfile

    text = (ROOT / "docs/reference/hosts-file.md").read_text()
    keys = [hostfile.BUILD, hostfile.LISTEN, *hostfile.KEYS]
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"docs/reference/hosts-file.md does not describe {missing}"


def test_a_change_in_the_code_makes_the_pages_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a new move or a new crash point changes what is generated."""
    import models.states
    from models.states import GenState
    from workflows.base import crash

    concepts = (ROOT / "docs/concepts.md").read_text()
    table = dict(models.states.TRANSITIONS)
    table[GenState] = {**table[GenState], GenState.proven: frozenset({GenState.current})}
    monkeypatch.setattr(models.states, "TRANSITIONS", table)
    assert docs.expected("docs/concepts.md") != concepts
    assert "    proven --> current\n" in docs.expected("docs/concepts.md")

    monkeypatch.setitem(crash.REGISTERED, "docs.example", "a point only this test defines")
    assert "`docs.example`" in docs.expected("docs/internals/crash-points.md")


def test_errors_page_names_every_exit_code() -> None:
    from models import errors

    text = (ROOT / "docs/reference/errors.md").read_text()
    classes: list[type[errors.VigilError]] = [
        c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.VigilError)]
    missing = [f"{c.__name__} ({c.exit_code})" for c in classes
               if f"| `{c.exit_code}` |" not in text or f"`{c.__name__}`" not in text]
    assert not missing, f"docs/reference/errors.md does not give the exit code of {missing}"
