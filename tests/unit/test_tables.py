"""The CLI's tables at a given width (runners/cli/output.py Fitted): every line fits, a long
cell is cut in the middle, only the last column wraps, and it goes under its row when less
than LAST_FLOOR columns would be left for it."""

from __future__ import annotations

from runners.cli.output import ELLIPSIS, LAST_FLOOR, UNDER, Fitted, middle

PATH = "/srv/releases/2026-12-02/build-4711/app/bin/server.sock"
REASON = "health: process exited before it answered; see `vigil events web` and its logs"


def fitted(*rows: tuple[str, ...]) -> Fitted:
    t = Fitted(("host", "state", "socket", "deploy"), None)
    for r in rows:
        t.add_row(*r)
    return t


def test_middle_keeps_both_ends() -> None:
    assert middle("/very/long/path/to/build", 15) == "/very/l" + ELLIPSIS + "o/build"
    assert middle("short", 15) == "short"
    assert len(middle(PATH, 9)) == 9


def test_wide_enough_nothing_is_cut_or_wrapped() -> None:
    lines = fitted(("web", "awake", PATH, REASON)).lines(200)
    assert len(lines) == 2 and PATH in lines[1] and lines[1].endswith(REASON)


def test_the_last_column_wraps_in_place_when_it_keeps_its_floor() -> None:
    lines = fitted(("web", "awake", PATH, REASON)).lines(80)
    assert all(len(line) <= 80 for line in lines), lines
    assert len(lines) > 2 and PATH not in "\n".join(lines)
    start = lines[0].index("deploy")
    assert start + LAST_FLOOR <= 80
    assert all(line[:start].strip() == "" for line in lines[2:])  # under its own column
    assert " ".join(line[start:] for line in lines[1:]).split() == REASON.split()


def test_the_last_column_goes_under_its_row_when_too_narrow() -> None:
    lines = fitted(("web", "awake", PATH, REASON), ("db", "asleep", "", "")).lines(40)
    assert all(len(line) <= 40 for line in lines), lines
    assert lines[0].split() == ["host", "state", "socket"]
    assert lines[1].startswith("web ") and ELLIPSIS in lines[1]
    under = [line for line in lines if line.startswith(UNDER)]
    assert " ".join(under).split() == REASON.split()
    assert lines[-1].split() == ["db", "asleep"]  # an empty last cell adds no line


def test_a_state_word_is_never_cut_the_other_cells_are() -> None:
    """Issue 39: at 80 columns `cras…oop` and `depl…ing` (a state cut like a path)."""
    t = Fitted(("host", "kind", "state", "gen", "pid", "build", "up for", "socket", "deploy"),
               None)
    for host, state in (("payments-api-eu1/0", "crashloop"), ("payments-api-eu1", "deploying")):
        t.add_row(host, "instance", state, "g1234", "4123456", PATH, "3h 20m", PATH, REASON)
    lines = t.lines(60)
    rows = [line.split() for line in lines if line.startswith("paym")]
    assert [r[2] for r in rows] == ["crashloop", "deploying"], lines
    assert ELLIPSIS in rows[0][0] and ELLIPSIS in rows[0][5], lines  # the others are cut


def test_the_agent_line_breaks_between_its_phrases() -> None:
    """Issue 39: rich wrapped it at a word (`..., up 8s, last` / `round 0s ago, ...`)."""
    from datetime import UTC, datetime

    from runners.cli.output import MORE, Phrases, agent_line, agent_phrases

    now = datetime.now(UTC).isoformat()
    info = {"running": True, "state_dir": "/tmp/vgdejdypq1/state", "pid": 31374,
            "box": "vm-72c5a00e", "up_since": now, "last_round": now, "open_obligations": 3}
    phrases = agent_phrases(info)
    lines = Phrases(phrases).lines(80)
    assert len(lines) == 2 and lines[0].startswith("agent: running on"), lines
    assert all(ln.startswith(MORE) for ln in lines[1:]) and all(len(ln) <= 80 for ln in lines)
    assert all(any(p in ln for ln in lines) for p in phrases), lines  # each phrase whole
    assert any(ln.strip().startswith("last round ") for ln in lines), lines
    assert agent_line(info) == " ".join(phrases)
    assert agent_line({**info, "up_since": None, "last_round": None}) == (
        "agent: running on /tmp/vgdejdypq1/state, pid 31374, box vm-72c5a00e, "
        "3 open obligations")
