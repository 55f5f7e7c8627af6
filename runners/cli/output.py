"""What people read: ages, tables (rich) and event lines for the CLI. `--json` output is
built elsewhere and never goes through here."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # events are read from the store; ages and tables need no SQLAlchemy
    from models.store import Store
    from models.tables import Event


def utcnow() -> datetime:
    """Naive UTC, as the store keeps times (models.store.utcnow, without its imports)."""
    return datetime.now(UTC).replace(tzinfo=None)


def age(when: datetime | str | None, now: datetime | None = None) -> str:
    """`4s`, `3m12s`, `2h05m`, `3d04h` since `when` (naive UTC or ISO text ending in Z)."""
    if when is None:
        return ""
    if isinstance(when, str):
        when = datetime.fromisoformat(when.removesuffix("Z"))
    if when.tzinfo is not None:
        when = when.astimezone(UTC).replace(tzinfo=None)
    return duration(((now or utcnow()) - when).total_seconds())


def duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def until(when: datetime | str | None) -> str:
    if when is None:
        return ""
    if isinstance(when, str):
        when = datetime.fromisoformat(when.removesuffix("Z"))
    left = (when - utcnow()).total_seconds()
    return "due" if left <= 0 else f"in {duration(left + 0.999)}"


ELLIPSIS = "…"
GAP = "  "  # between columns
CELL_FLOOR = 8  # a column is cut no narrower than this (or its heading)
LAST_FLOOR = 20  # narrower than this, the last column goes on lines of its own, under its row
UNDER = "    "  # the indent of a last column put under its row
WHOLE = ("kind", "state", "outcome")  # columns of one word each, never cut (`cras…oop`)
MORE = "  "  # the indent of a line of phrases that goes on (the agent's line)


def table(*columns: str, title: str | None = None) -> Fitted:
    return Fitted(columns, title)


def show(t: Any) -> None:
    from rich.console import Console

    Console().print(t)


def middle(text: str, width: int) -> str:
    """`/very/lo…/build`: cut in the middle, where a long path says least."""
    if len(text) <= width:
        return text
    head = width // 2
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail > 0 else "")


def narrowed(natural: list[int], floors: list[int], room: int) -> list[int]:
    """The widths, the widest cut first, one column at a time, until they fit `room` or
    every column is at its floor."""
    w = list(natural)
    while sum(w) > room:
        cut = [i for i in range(len(w)) if w[i] > floors[i]]
        if not cut:
            break
        w[max(cut, key=lambda i: w[i])] -= 1
    return w


def wrapped(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, max(1, width), break_on_hyphens=False) or [""]


class Fitted:
    """A table that fits the console's width (80 columns when not a terminal): each column
    but the last on one line, a long cell cut in the middle; the last column wraps (and
    goes under its row when too little is left of the width for it)."""

    def __init__(self, columns: tuple[str, ...], title: str | None) -> None:
        self.columns, self.title = columns, title
        self.rows: list[list[str]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append([str(c) for c in cells])

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text  # the lines fit already; a cell is never read as markup

        yield Text("\n".join(self.lines(options.max_width)), no_wrap=True, overflow="ignore")

    def lines(self, width: int) -> list[str]:
        heads, rows = list(self.columns), self.rows
        natural = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads)]
        floors = [n if h in WHOLE else min(n, max(len(h), CELL_FLOOR))
                  for h, n in zip(heads, natural, strict=True)]
        room = width - len(GAP) * (len(heads) - 1)
        fixed = narrowed(natural[:-1], floors[:-1], room - min(natural[-1], LAST_FLOOR))
        last = room - sum(fixed)
        under = last < min(natural[-1], LAST_FLOOR)
        if under:  # the other columns get the whole width, the last one's gap too
            fixed = narrowed(natural[:-1], floors[:-1], width - len(GAP) * (len(heads) - 2))
        out = [self.title] if self.title else []
        out.append(self._line(heads[:-1], fixed, [] if under else [heads[-1]]))
        for r in rows:
            tail = [] if under else wrapped(r[-1], last)
            out.append(self._line(r[:-1], fixed, tail[:1]))
            pad = " " * (sum(fixed) + len(GAP) * len(fixed))
            out.extend((pad + more).rstrip() for more in tail[1:])
            if under and r[-1]:
                out.extend(UNDER + more for more in wrapped(r[-1], width - len(UNDER)))
        return out

    @staticmethod
    def _line(cells: list[str], widths: list[int], last: list[str]) -> str:
        parts = [middle(c, w).ljust(w) for c, w in zip(cells, widths, strict=True)] + last
        return GAP.join(parts).rstrip()


def status_table(rows: list[dict[str, Any]]) -> Any:
    t = table("host", "kind", "state", "gen", "pid", "build", "up for", "socket", "deploy")
    for r in rows:
        if "slots" in r:
            _instance_rows(t, r)
            continue
        t.add_row(r["host"], r["kind"], r["state"],
                  f"g{r['generation']}" if r["generation"] else "", str(r["pid"] or ""),
                  _build(r), age(r["since"]), _where(r), _news(r))
    return t


def _instance_rows(t: Any, r: dict[str, Any]) -> None:
    """A host of instances: its row says how many serve, then one row per slot
    (`web/0`, `web/1`, ...) with its generation, pid and time up."""
    up = sum(1 for x in r["slots"] if x["generation"])
    t.add_row(r["host"], r["kind"], r["state"], f"{up}/{r['instances']}", "", _build(r), "",
              _where(r), _news(r))
    for x in r["slots"]:
        t.add_row(f"{r['host']}/{x['slot']}", "", x["state"],
                  f"g{x['generation']}" if x["generation"] else "", str(x["pid"] or ""), "",
                  age(x["since"]), "", "")


def _build(r: dict[str, Any]) -> str:
    """The build's digest, and beside it the name of the file it was staged from."""
    digest = (r["build_digest"] or "")[:12]
    return f"{digest} {r['build_file']}" if digest and r.get("build_file") else digest


def _news(r: dict[str, Any]) -> str:
    """The last column: a wake held back by the start order says what it waits on; a
    restart waiting after a crash says how the leader ended; else where the last deploy
    is, else why it is not running."""
    if r.get("waiting_on"):
        return f"waiting on {', '.join(r['waiting_on'])}"
    if r.get("kind") == "job":
        return job_line(r)
    ended = r.get("last_exit")
    if ended and r.get("restart_at") and r["generation"] is None:
        return f"{ended['status']} {age(ended['at'])} ago, restart {until(r['restart_at'])}"
    return r.get("deploy") or r.get("problem") or ""


def job_line(r: dict[str, Any]) -> str:
    """A job's news, as status, top and the page say it: its run in flight, when its next
    run is due (none: its schedule is disabled), how its last run ended:
    `run #13 running, next in 4s, last #12 failed (exit 3) 1m02s ago`."""
    parts = []
    if r.get("run"):
        parts.append(f"run #{r['run']['id']} {r['run']['state']}")
    parts.append(f"next {until(r['next_run'])}" if r.get("next_run") else "disabled")
    last = r.get("last_run")
    if last is None:
        parts.append("no run yet")
    else:
        code = last["exit_status"]
        how = last["state"] + (f" (exit {code})" if code not in (None, 0) else "")
        parts.append(f"last #{last['id']} {how} {age(last['ended_at'])} ago")
    return ", ".join(parts)


def _where(r: dict[str, Any]) -> str:
    """Its own socket, or its shared listeners (a lost one, bound again at the next start,
    and a reopened one say so)."""
    tags = {"lost": " (lost)", "opening": " (opening)"}
    shared = [f"{lst['address']}{' (reopened)' if lst.get('reopened') else ' (closed)' if lst.get('closed') else tags.get(lst['state'], '')}"
              for lst in r.get("listeners", [])]
    return ", ".join(shared) or r["socket"] or ""


def agent_line(info: dict[str, Any]) -> str:
    """The agent, in one line: `vigil status`'s header."""
    return " ".join(agent_phrases(info))


def agent_phrases(info: dict[str, Any]) -> list[str]:
    """The agent's line in phrases, each with its punctuation: where it may wrap."""
    n = info.get("open_obligations") or 0
    open_ = f"{n} open obligation{'' if n == 1 else 's'}"
    if not info.get("running"):
        head = f"agent: not running on {info['state_dir']}"
        waits = [f"{head};", f"{open_} wait for it"] if n else [head]
        return [*waits, "(start it with `vigil agent start`)"]
    parts = [f"agent: running on {info['state_dir']}", f"pid {info['pid']}", f"box {info['box']}"]
    if info.get("up_since"):
        parts.append(f"up {age(info['up_since'])}")
    if info.get("last_round"):
        parts.append(f"last round {age(info['last_round'])} ago")
    return [p + "," for p in parts] + [open_]


class Phrases:
    """Phrases on lines that fit the console's width, each line after the first indented:
    a line breaks between phrases, never inside one (`last round 3s` / `ago`)."""

    def __init__(self, phrases: list[str]) -> None:
        self.phrases = phrases

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield Text("\n".join(self.lines(options.max_width)))  # one phrase wider: folded

    def lines(self, width: int) -> list[str]:
        out = [self.phrases[0]]
        for p in self.phrases[1:]:
            if len(out[-1]) + 1 + len(p) <= width:
                out[-1] += " " + p
            else:
                out.append(MORE + p)
        return out


def obligations_table(rows: list[dict[str, Any]]) -> Any:
    t = table("kind", "host", "gen", "open for", "tries", "next try", "last error")
    for r in rows:
        t.add_row(r["kind"], r["host"], f"g{r['generation']}" if r["generation"] else "",
                  age(r["since"]), str(r["attempts"]), until(r["next_attempt_at"]),
                  r["last_error"] or "")
    return t


# -- rollouts -------------------------------------------------------------------------------

def progress(done: int, total: int, width: int = 20) -> str:
    """`[########------------] 3/6`"""
    filled = round(width * done / total) if total else 0
    return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}"


def status_heading(st: dict[str, Any]) -> str:
    """The lines above a rollout's table: where it is, its progress, why it stopped."""
    c = st["counts"]
    state = st["state"] if st["outcome"] is None else f"ended {st['outcome']}"
    lines = [f"rollout #{st['id']}  build {st['build'][:12]}  {state}  "
             f"wave {st['wave']} of {st['wave_count']} ({st['settled']} settled)  "
             f"mode {st['mode']}{' canary' if st['canary'] else ''}  waves {st['waves']}",
             f"moved {progress(st['moved'], st['hosts'])}  failed {c.get('failed', 0)} "
             f"(max {st['max_failures']})"
             + "".join(f"  {k} {c[k]}" for k in ("abandoned", "skipped", "reverted",
                                                 "revert_failed") if c.get(k))
             + ("  auto-revert" if st["auto_revert"] else "")
             + (f"  pause {st['pause']:g}s" if st["pause"] else "")]
    if st["reason"]:
        lines.append(f"reason: {st['reason']}")
    if st["next_wave_at"] and st["outcome"] is None:
        lines.append(f"next wave {until(st['next_wave_at'])}")
    if st["last_error"]:
        lines.append(f"now: {st['last_error']}")
    return "\n".join(lines)


def targets_table(targets: list[dict[str, Any]]) -> Any:
    t = table("wave", "host", "state", "attempt", "outcome", "executed", "drain", "reason")

    def cells(a: dict[str, Any] | None) -> list[str]:
        if a is None:
            return ["", "", "", ""]
        drain = f"{a['drain_seconds']:.2f}s" if a["drain_seconds"] is not None else ""
        executed = "" if a["executed"] is None else str(a["executed"]).lower()
        return [f"#{a['id']}", a["outcome"] or a["step"], executed, drain]

    for r in targets:
        wave = str(r["wave"]) if r["wave"] else "-"
        t.add_row(wave, r["host"], r["state"], *cells(r["attempt"]), r["reason"] or "")
        if r["revert_attempt"] is not None:
            t.add_row("", "", "  revert", *cells(r["revert_attempt"]), "")
    return t


def rollouts_table(rows: list[dict[str, Any]]) -> Any:
    t = table("id", "build", "state", "waves", "moved", "failed", "started", "reason")
    for r in rows:
        state = r["state"] if r["outcome"] is None else r["outcome"]
        t.add_row(f"#{r['id']}", r["build"][:12], state,
                  f"{r['settled']}/{r['wave_count']}", f"{r['moved']}/{r['hosts']}",
                  str(r["counts"].get("failed", 0)), f"{age(r['created_at'])} ago",
                  r["reason"] or "")
    return t


# -- events ---------------------------------------------------------------------------------

def event_dict(e: Event) -> dict[str, Any]:
    return {"id": e.id, "at": e.at.isoformat() + "Z", "host": e.host, "generation": e.generation_id,
            "kind": e.kind, "detail": json.loads(e.detail)}


ROW_KEYS = ("attempt", "wake", "stop")  # detail keys holding a row's id: shown as #17
GENERATION_KEYS = ("retiring", "successor")  # detail keys holding a generation: g17


def detail_value(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        if key in ROW_KEYS:
            return f"#{value}"
        if key in GENERATION_KEYS:
            return f"g{value}"
    return str(value)


def event_line(d: dict[str, Any]) -> str:
    """`2026-11-29 19:02:03.120  web  g3  switched  attempt=#4 retiring=g2`: generations are
    g<N> (the third column is the event's own), rows' ids #<N>."""
    at = d["at"].removesuffix("Z").replace("T", " ")[:23]
    gen = f"g{d['generation']}" if d["generation"] else "-"
    extra = " ".join(f"{k}={detail_value(k, v)}" for k, v in d["detail"].items())
    return f"{at:<23}  {d['host'] or '-':<16} {gen:<5} {d['kind']:<18} {extra}".rstrip()


def events_after(store: Store, host: str | None, after: int, limit: int) -> list[dict[str, Any]]:
    """Events with id > after, oldest first; with after < 0, the newest `limit` of them."""
    from sqlalchemy import select

    from models.tables import Event

    def q(s):  # type: ignore[no-untyped-def]
        stmt = select(Event)
        if host:
            stmt = stmt.where(Event.host == host)
        if after < 0:
            return list(reversed(s.execute(stmt.order_by(Event.id.desc()).limit(limit))
                                 .scalars().all()))
        return list(s.execute(stmt.where(Event.id > after).order_by(Event.id).limit(1000))
                    .scalars().all())

    return [event_dict(e) for e in store.read(q)]


def follow(store: Store, host: str | None, last: int, emit: Callable[[dict[str, Any]], None],
           interval: float = 0.5) -> None:
    """Poll the events table by id until SIGTERM or Ctrl-C; both end it cleanly."""
    # A plain flag, not an Event: a handler calling Event.set() can deadlock on the lock the
    # interrupted main thread holds inside Event.wait().
    stop = [False]

    def on_term(*_: object) -> None:
        stop[0] = True

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while not stop[0]:
            for d in events_after(store, host, last, 0):
                emit(d)
                last = d["id"]
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
