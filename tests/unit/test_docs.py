"""The documentation keeps up with the code: the generated pages (CLI reference, state
diagrams, crash points) equal what runners/cli/docs.py writes now, the README stays a
landing page whose docs/ links all exist and whose code map names every folder, the
glossary names every coined word, and the hosts-file page names every key."""

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


# The words vigil coins, each of which must have a row in the glossary (docs/concepts.md,
# "Words"). A new word in the code or the docs goes here and there together.
COINED = """
adopt agent app attempt backstop bookkeeping box build canary carrier cause chore coalesce
containment converge crashloop current delivery desired doorbell drain drift drive epoch
fence generation gate halt hold host instance intent keeper kind lease leader listener
member mode notifier obligation one-shot outcome overlap pacing placement poked probe
proven raised reap reconciler recovery recycle release restore retiring ring rollout round
slot standby step stop store streak successor sweep swap switch takeover target trust
unproven waiting wake walk wave worker
""".split() + ["box lease", "canonical link", "captured build", "crash point", "exit watch",
               "failure book", "fd holder", "fence keeper", "generation start", "group wake",
               "held down", "known process", "live build", "log keeper", "operation set",
               "parent limit", "protocol fact", "quick path", "settle window", "state dir"]


def glossary_rows() -> list[str]:
    """The glossary's words in the order of its rows (`held (listener)`: one of two senses)."""
    text = (ROOT / "docs/concepts.md").read_text()
    table = text[text.index("## Words"):text.index("\n## ", text.index("## Words") + 1)]
    return re.findall(r"^\| ([^|]+?) \|", table, re.M)[2:]  # past `word` and `---`


def glossary() -> set[str]:
    return {re.sub(r" \(.*\)$", "", w) for w in glossary_rows()}


def test_the_glossary_is_in_alphabetical_order() -> None:
    rows = glossary_rows()
    assert rows == sorted(rows, key=str.lower), "docs/concepts.md: keep the glossary's rows sorted"


def singular(table: str) -> str:
    """The word of one row of a table: `rollout_targets` -> `target`."""
    word = table.rsplit("_", 1)[-1]
    return word[:-3] + "y" if word.endswith("ies") else word.removesuffix("s")


def test_the_glossary_names_every_coined_word() -> None:
    from models.states import TRANSITIONS
    from models.tables import Base

    words = glossary()
    missing = [w for w in COINED if w not in words]
    assert not missing, f"docs/concepts.md's glossary has no row for {missing}"
    # Every table with a state column of the transition table is a thing the glossary names
    # (`hosts.desired`: host; `rollout_targets.state`: target).
    stateful = {singular(t.name) for t in Base.metadata.tables.values()
                for c in t.columns if getattr(c.type, "enum_class", None) in TRANSITIONS}
    assert {"generation", "wake", "stop", "attempt", "member", "host", "target"} <= stateful
    missing = sorted(stateful - words)
    assert not missing, f"docs/concepts.md's glossary has no row for {missing}"


def test_the_glossary_names_every_obligation_kind() -> None:
    from workflows.engine.obligations import KINDS

    missing = sorted(set(KINDS) - glossary())
    assert not missing, f"docs/concepts.md's glossary has no row for the obligations {missing}"


def test_the_code_map_names_every_folder() -> None:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Code map"):text.index("## Tests")]
    names = [f"{top}/" for top in ("models", "migrations", "workflows", "runners", "tests")]
    for top in ("workflows", "runners"):
        names += [f"  {d.name}/" for d in sorted((ROOT / top).iterdir())
                  if (d / "__init__.py").exists()]
    names += [f.name for f in sorted((ROOT / "runners").glob("*.py")) if f.name != "__init__.py"]
    missing = [n for n in names if n not in block]
    assert not missing, f"README.md's code map does not name {missing}"


# A module name two layers share, allowed only with why: the two sides of one port may keep
# one name (none does now).
SHARED_NAMES: dict[str, str] = {}


def test_a_module_name_is_used_in_one_layer_only() -> None:
    layers: dict[str, set[str]] = {}
    for top in ("models", "workflows", "runners"):
        for f in (ROOT / top).rglob("*.py"):
            if f.name not in ("__init__.py", "__main__.py"):
                layers.setdefault(f.name, set()).add(top)
    shared = sorted(n for n, tops in layers.items() if len(tops) > 1 and n not in SHARED_NAMES)
    assert not shared, f"module names used in two layers (rename the runners side): {shared}"


PATH_IN_TEXT = re.compile(r"\b(?:models|workflows|runners|tests|bench|scripts|migrations)/"
                          r"[\w./-]*\w")


def test_every_path_a_page_names_exists() -> None:
    """A module renamed or merged away leaves no page pointing at it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = [f"{page.relative_to(ROOT)}: {path}" for page in pages
               for path in sorted(set(PATH_IN_TEXT.findall(page.read_text())))
               if not (ROOT / path).exists()]
    assert not missing, f"pages name files that do not exist: {missing}"
