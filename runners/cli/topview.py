"""What `vigil top` shows, one frame at a time: the rows that fit (workflows/config/glance.py
reads only those in full), each generation's CPU and memory from the box (psutil), the agent's
line and the last events; drawn for a terminal (rich) or as a plain table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from runners.backend.process import cgroup_pids
from runners.base.pids import CTIME_TOLERANCE
from runners.cli.output import age, event_line, job_line

if TYPE_CHECKING:
    from models.store import Store

EVENTS = 3  # the footer's last events, when the terminal is tall enough
CHROME = 4  # lines that are not host rows or events: title, table header, "more", agent
SHORT = {"crash": "c", "restart": "r", "recycle": "y", "converge": "v"}  # restarts, by cause
AGENT_TIMEOUT = 0.5  # the agent's own line through its socket; a slow agent is read from the store


@dataclass
class Frame:
    total: int  # every host in the store
    offset: int  # the first row shown
    rows: list[dict[str, Any]]
    agent: dict[str, Any]
    halted: str | None
    events: list[dict[str, Any]] = field(default_factory=list)


class Sampler:
    """CPU % and RSS of a whole generation: its cgroup's processes, else its leader and the
    leader's descendants. A process is kept from one frame to the next, so its CPU % is over
    the time between two frames (psutil's cpu_percent with no interval)."""

    def __init__(self) -> None:
        self.procs: dict[tuple[int, float], psutil.Process] = {}

    def sample(self, leaders: dict[str, dict[str, Any]]) -> dict[str, tuple[float, int]]:
        from runners.backend.descendants import walk
        from workflows.base.ports import ProcRef

        trees = walk([ProcRef(host, ld["pid"], ld["create_time"], None)
                      for host, ld in leaders.items() if not ld["cgroup"]])
        out: dict[str, tuple[float, int]] = {}
        seen: set[tuple[int, float]] = set()
        for host, ld in leaders.items():
            # No cgroup: the leader (when it is still the recorded process: a leader with no
            # children of its own is one too) and its descendants.
            leader = self._one(ld["pid"], seen, ld["create_time"]) if not ld["cgroup"] else None
            pids = (cgroup_pids(ld["cgroup"]) if ld["cgroup"]
                    else [p for p, _ in trees.get(host, ())] if leader is not None else [])
            cpu, rss = leader if leader is not None else (0.0, 0)
            for pid in pids:
                got = self._one(pid, seen)
                if got is not None:
                    cpu, rss = cpu + got[0], rss + got[1]
            if pids or leader is not None:
                out[host] = (cpu, rss)
        for key in set(self.procs) - seen:
            del self.procs[key]
        return out

    def _one(self, pid: int, seen: set[tuple[int, float]],
             born: float | None = None) -> tuple[float, int] | None:
        try:
            p = psutil.Process(pid)
            key = (pid, p.create_time())
            if born is not None and abs(key[1] - born) > CTIME_TOLERANCE:
                return None  # the pid is another process's now
            p = self.procs.setdefault(key, p)
            with p.oneshot():
                got = p.cpu_percent(None), p.memory_info().rss
            seen.add(key)
            return got
        except psutil.Error:  # gone, a zombie, not ours to read
            return None


def agent_of(store: Store, state_dir: Path, db: str | None) -> dict[str, Any]:
    """The agent's own line: from the agent through its control socket when it answers soon
    (it alone knows its last round), else what the store and its lock say."""
    from runners.quick import ops
    from runners.quick.client import Client, Lost, OtherStore

    c = Client.connect(state_dir, db)
    if c is not None:
        try:
            return dict(c.call("agent", AGENT_TIMEOUT))
        except (Lost, OtherStore, ValueError):
            pass
        finally:
            c.dispose()
    return ops.agent_info(store, state_dir)


def read(store: Store, state_dir: Path, db: str | None, offset: int, fit: int | None,
         events: int, sampler: Sampler) -> Frame:
    """One frame: `fit` rows from `offset` (None: every host), read in one transaction."""
    from runners.base.doorbell import halted_line
    from runners.cli.output import events_after
    from workflows.config.glance import glance, names

    def q(s):  # type: ignore[no-untyped-def]
        every = names(s)
        start = max(0, min(offset, len(every) - (fit or len(every))))
        return len(every), start, glance(s, every[start:None if fit is None else start + fit])

    total, start, rows = store.read(q)
    if fit is not None:
        rows = fitted(rows, fit)
    usage = sampler.sample({f"{r['host']}#{n}": ld for r in rows
                            for n, ld in r["leaders"].items() if ld["pid"]})
    for r in rows:
        mine = [usage[k] for k in (f"{r['host']}#{n}" for n in sorted(r["leaders"]))
                if k in usage]
        r["usage"] = (sum(c for c, _ in mine), sum(m for _, m in mine)) if mine else None
        for sl in r.get("slots") or ():
            sl["usage"] = usage.get(f"{r['host']}#{sl['slot']}")
    return Frame(total, start, rows, agent_of(store, state_dir, db), halted_line(state_dir),
                 events_after(store, None, -1, events) if events else [])


def fitted(rows: list[dict[str, Any]], fit: int) -> list[dict[str, Any]]:
    """The rows whose lines fit `fit` screen lines: a host of instances takes one line and
    one more for each slot; the first row is always kept."""
    kept: list[dict[str, Any]] = []
    used = 0
    for r in rows:
        used += 1 + len(r.get("slots") or ())
        if kept and used > fit:
            break
        kept.append(r)
    return kept


# -- cells -----------------------------------------------------------------------------------

def health(r: dict[str, Any]) -> str:
    if "health_interval" not in r or r.get("generation") is None:
        return "-"
    if r.get("unhealthy_since"):
        return "unhealthy"
    failures = r.get("health_failures") or 0
    return f"fail {failures}/{r['unhealthy_after']}" if failures else "ok"


def restarts(r: dict[str, Any], short: bool) -> str:
    counts = {k: v for k, v in sorted(r["restarts"].items()) if v}
    if short:
        return " ".join(f"{SHORT[k]}{v}" for k, v in counts.items()) or "0"
    return " ".join(f"{k}={v}" for k, v in counts.items()) or "0"


def owed(r: dict[str, Any], short: bool) -> str:
    rows = r["obligations"]
    if not rows:
        return ""
    if short:  # the oldest, and how many more
        more = f" +{len(rows) - 1}" if len(rows) > 1 else ""
        return f"{rows[0]['kind']} {age(rows[0]['since'])}{more}"
    return ", ".join(f"{o['kind']} {age(o['since'])}" for o in rows)


def in_flight(r: dict[str, Any]) -> str:
    """The rollout the host is in, else its deploy in flight with its step, else why it is
    down (a failed start), else how its last leader ended while nothing runs (`oom`); a
    job's: its run in flight, next run and last result (as `vigil status` says them)."""
    if r.get("kind") == "job":
        return job_line(r)
    ro = r.get("rollout")
    if ro is not None:
        return f"rollout #{ro['id']} w{ro['wave']}/{ro['wave_count']} {ro['target']}"
    a = r.get("last_attempt")
    if a is not None and a["outcome"] is None:
        return f"deploy #{a['id']} {a['step']}"
    ended = r.get("last_exit")
    if not r.get("problem") and ended and r.get("generation") is None:
        return f"{ended['status']} {age(ended['at'])} ago"
    return str(r.get("problem") or "")


def usage(r: dict[str, Any]) -> tuple[str, str]:
    if r.get("usage") is None:
        return "", ""
    cpu, rss = r["usage"]
    return f"{cpu:.1f}", f"{rss / 2**20:.1f}M"


def cells(r: dict[str, Any], short: bool) -> list[str]:
    cpu, rss = usage(r)
    return [r["host"], r["state"], f"g{r['generation']}" if r["generation"] else "",
            str(r["pid"] or ""), age(r["since"]), restarts(r, short), health(r), cpu, rss,
            owed(r, short), in_flight(r)]


def slot_cells(r: dict[str, Any], sl: dict[str, Any]) -> list[str]:
    """A host of instances' line for one slot: `web/1`, its word, generation, pid, up time,
    restart streak when it has one, CPU % and RSS (named as `vigil status` names it)."""
    cpu, rss = usage(sl)
    streak = sl.get("restart_streak") or 0
    return [f"{r['host']}/{sl['slot']}", sl["state"],
            f"g{sl['generation']}" if sl["generation"] else "", str(sl["pid"] or ""),
            age(sl["since"]) if sl["since"] else "", f"streak {streak}" if streak else "",
            "", cpu, rss, "", ""]


def host_lines(r: dict[str, Any], short: bool) -> list[list[str]]:
    """A host's line, then one per slot for a host of instances."""
    return [cells(r, short), *(slot_cells(r, sl) for sl in r.get("slots") or ())]


COLUMNS = ("host", "state", "gen", "pid", "up", "restarts", "health", "cpu%", "rss",
           "obligations", "deploy")


def agent_text(info: dict[str, Any], halted: str | None) -> str:
    """`agent: running, not halted, box B, pid P, up 3m (since 12:00:01), last round 0s
    ago, 2 open obligations`: whether it acts first, so a narrow screen cuts the rest."""
    n = info.get("open_obligations") or 0
    open_ = f"{n} open obligation{'' if n == 1 else 's'}"
    if not info.get("running"):
        return f"agent: not running ({open_}; start it with `vigil agent start`)"
    parts = [f"HALTED: {halted}" if halted else "not halted", f"box {info['box']}",
             f"pid {info['pid']}"]
    if info.get("up_since"):
        parts.append(f"up {age(info['up_since'])} (since "
                     f"{str(info['up_since'])[:19].replace('T', ' ')} UTC)")
    if info.get("last_round"):
        parts.append(f"last round {age(info['last_round'])} ago")
    return f"agent: running, {', '.join(parts)}, {open_}"


# -- drawn -----------------------------------------------------------------------------------

def fit_rows(height: int) -> tuple[int, int]:
    """(host rows, event lines) for a terminal `height` lines tall."""
    events = EVENTS if height >= 12 else 0
    return max(1, height - CHROME - events), events


def screen(f: Frame, when: str, selected: str | None = None,
           said: tuple[str, str] | None = None) -> Any:
    """The frame for a terminal: every line cut, never wrapped, to the screen's width. The
    `selected` host's lines are drawn reversed; `said` (text, style), a question or what an
    action did, replaces the line under the table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold reverse",
              expand=True)
    for name in COLUMNS:
        if name == "obligations":
            name = "owed"  # the screen's narrow header
        grow = name in ("host", "deploy", "owed")
        t.add_column(name, no_wrap=True, overflow="ellipsis", ratio=1 if grow else None,
                     justify="right" if name in ("pid", "cpu%", "rss", "gen") else "left")
    for r in f.rows:
        for i, row in enumerate(host_lines(r, True)):
            word = r["state"] if i == 0 else row[1]
            style = "red" if word in TROUBLE else ""
            t.add_row(*row, style=(style + " reverse").strip() if r["host"] == selected
                      else style or None)
    last = f.offset + len(f.rows)
    more = (f"hosts {f.offset + 1}-{last} of {f.total}"
            + (f", {f.total - last} more" if last < f.total else "")
            + ("  (arrows, PgUp/PgDn: select; r/s/w: restart/stop/wake it; q: quit)"))

    def line(s: str, style: str | None = None) -> Text:
        return Text(s, style=style or "", no_wrap=True, overflow="ellipsis")

    head = line(f"vigil top  {when}  {f.total} host{'' if f.total == 1 else 's'}", "bold")
    return Group(head, t, line(*said) if said else line(more, "dim"),
                 line(agent_text(f.agent, f.halted), "bold red" if f.halted else "bold"),
                 *(line(event_line(e)) for e in f.events))


TROUBLE = ("unproven", "crashloop", "unhealthy", "down", "failed")


def plain(f: Frame) -> str:
    """The frame without a terminal: the agent's line, then every host, columns aligned."""
    rows = [list(COLUMNS), *(row for r in f.rows for row in host_lines(r, False))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [agent_text(f.agent, f.halted)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return "\n".join(lines) + "\n"
