"""The chaos test's own checker. It trusts neither `vigil status` nor `vigil check`: it reads
the process table (psutil), the kernel's listening sockets (/proc/net/tcp), plain HTTP
answers, the apps' log files, and the store's rows directly (`pending_obligations`, the
events and the attempts, by SQL). Each finding is one line naming the host and what is
wrong; an empty list is a pass."""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from sqlalchemy import text

from tests.chaos.world import JOB, HostSpec, Proc, generation_procs, get, listening_inodes
from tests.conftest import Vigil

TICK = re.compile(r"tick (\d+)$")


def digest_labels(builds: dict[str, Path]) -> dict[str, str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest(): label for label, p in builds.items()}


def rows(v: Vigil, sql: str, **params: object) -> list[dict]:
    with v.store.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text(sql), params)]


@dataclass
class Checker:
    v: Vigil
    hosts: list[HostSpec]
    labels: dict[str, str]  # digest -> build label
    logs: bool  # check that no log line is lost
    inodes: dict[str, int] = field(default_factory=dict)  # host -> its listener's inode
    first_event: int = 0  # events before it are the set-up's
    job_ran: Path | None = None  # the job's file: "<pid> <scheduled instant>" a run (world.JOB)

    def baseline(self) -> None:
        """The listeners' inodes once every host is up, and where the events of the run begin."""
        for h in self.hosts:
            if h.port is not None:
                (self.inodes[h.name],) = listening_inodes(h.port)
        self.first_event = max((r["id"] for r in rows(self.v, "SELECT id FROM events")), default=0)

    def check(self, meant_up: dict[str, bool]) -> list[str]:
        found = [f"open obligation: {o}" for o in self.v.obligations()]
        procs = generation_procs(self.v.state_dir, self.v.db_url)
        found += self.processes(procs, meant_up)
        found += self.serving(procs, meant_up)
        found += self.listeners()
        found += self.dropped()
        if self.logs:
            found += self.lost_lines()
        if self.job_ran is not None:
            found += self.job_runs(procs)
        return found

    def job_runs(self, procs: list[Proc]) -> list[str]:
        """The job (stopped before the checks): no instant started twice (its file), every
        run row closed or owed, every instant that ran has its row naming a generation,
        every generation of it proven and none of its processes left."""
        out = []
        ran = [ln.split() for ln in self.job_ran.read_text().splitlines()] \
            if self.job_ran is not None and self.job_ran.exists() else []
        seen: dict[str, int] = defaultdict(int)
        for _, at in ran:
            seen[at] += 1
        out += [f"{JOB}: instant {at} ran {n} times" for at, n in seen.items() if n > 1]
        runs = {_instant(r["scheduled_at"]): r for r in rows(
            self.v, "SELECT scheduled_at, state, generation_id FROM job_runs WHERE host = :h",
            h=JOB)}
        open_runs = [at for at, r in runs.items() if r["state"] in ("due", "running", "queued")]
        owed = rows(self.v, "SELECT host FROM pending_obligations WHERE kind = 'job_run' "
                            "AND host = :h", h=JOB)
        if len(open_runs) != len(owed):
            out.append(f"{JOB}: {len(open_runs)} open runs {open_runs}, {len(owed)} owed")
        for at in seen:
            r = runs.get(_instant(at))
            if r is None or r["generation_id"] is None:
                out.append(f"{JOB}: {at} ran with no run row naming its generation ({r})")
        live = rows(self.v, "SELECT id, state FROM generations WHERE host = :h AND "
                            "state <> 'proven'", h=JOB)
        out += [f"{JOB}: generation g{g['id']} is {g['state']}, not proven" for g in live]
        left = [p.pid for p in procs if p.host == JOB]
        if left:
            out.append(f"{JOB}: processes left after its stop: {left}")
        return out

    def processes(self, procs: list[Proc], meant_up: dict[str, bool]) -> list[str]:
        """No leaked or doubled generation: a host meant up has exactly one generation with
        live processes and one server in it; a host meant down has none."""
        by_host: dict[str, dict[str, list[Proc]]] = defaultdict(lambda: defaultdict(list))
        for p in procs:
            by_host[p.host][p.marker].append(p)
        out = []
        for host in set(by_host) - {h.name for h in self.hosts}:
            out.append(f"{host}: processes of an unknown host {dict(by_host[host])}")
        for h in self.hosts:
            gens = by_host.get(h.name, {})
            want = 1 if meant_up.get(h.name, True) else 0
            if len(gens) != want:
                out.append(f"{h.name}: {len(gens)} generations have live processes, want {want}: "
                           + "; ".join(f"{m[:8]}: pids {[p.pid for p in ps]}"
                                       for m, ps in gens.items()))
            for marker, ps in gens.items():
                servers = [p.pid for p in ps if p.leader]
                if len(servers) != 1:
                    out.append(f"{h.name}: generation {marker[:8]} has {len(servers)} servers "
                               f"{servers} (processes {[p.pid for p in ps]})")
        return out

    def expected_build(self, host: str) -> str | None:
        done = rows(self.v, "SELECT digest FROM attempts WHERE host = :h AND outcome = 'done' "
                            "ORDER BY id DESC LIMIT 1", h=host)
        return self.labels.get(done[0]["digest"], "?") if done else None

    def serving(self, procs: list[Proc], meant_up: dict[str, bool]) -> list[str]:
        """Every host meant up answers, from its one server, on the build of its newest
        attempt that was done."""
        out = []
        for h in self.hosts:
            if not meant_up.get(h.name, True):
                continue
            got = get(self.v, h)
            if not isinstance(got, tuple):
                out.append(f"{h.name}: meant up, does not answer ({got})")
                continue
            pid, build = got
            servers = {p.pid for p in procs if p.host == h.name and p.leader}
            if pid not in servers:
                out.append(f"{h.name}: answered by pid {pid}, not one of its servers {servers}")
            want = self.expected_build(h.name) or "a"
            if build != want:
                out.append(f"{h.name}: serves build {build}, its newest done attempt is {want}")
        return out

    def listeners(self) -> list[str]:
        """Every listener is the very socket it was (same inode), unless a
        `listener_reopened` event of the host says why it is not."""
        out = []
        for h in self.hosts:
            if h.port is None:
                continue
            now = listening_inodes(h.port)
            events = rows(self.v, "SELECT kind, detail FROM events WHERE host = :h AND id > :n "
                                  "AND kind LIKE 'listener%' ORDER BY id", h=h.name, n=self.first_event)
            why = "; ".join(f"{e['kind']} {e['detail']}" for e in events)
            reopened = any(e["kind"] == "listener_reopened" for e in events)
            if len(now) != 1:
                out.append(f"{h.name}: {len(now)} sockets listen on 127.0.0.1:{h.port} "
                           f"(was inode {self.inodes.get(h.name)}){'; events: ' + why if why else ''}")
            elif h.name in self.inodes and now != {self.inodes[h.name]} and not reopened:
                out.append(f"{h.name}: the listener on port {h.port} is inode {min(now)}, was "
                           f"{self.inodes[h.name]}, and no listener_reopened event says why"
                           f"{'; events: ' + why if why else ''}")
        return out

    def dropped(self) -> list[str]:
        """No deploy dropped: a host's newest attempt is never abandoned (one interrupted
        by the agent's death is resumed by a new attempt)."""
        out = []
        for h in self.hosts:
            last = rows(self.v, "SELECT id, cause, outcome, reason FROM attempts WHERE host = :h "
                                "ORDER BY id DESC LIMIT 1", h=h.name)
            if last and last[0]["outcome"] == "abandoned":
                a = last[0]
                # An operator's stop written after the deploy supersedes it: not dropped.
                if rows(self.v, "SELECT id FROM stops WHERE host = :h AND created_at >= "
                                "(SELECT created_at FROM attempts WHERE id = :a)",
                        h=h.name, a=a["id"]):
                    continue
                out.append(f"{h.name}: attempt #{a['id']} ({a['cause']}) was abandoned and "
                           f"nothing came after it: {a['reason']}")
        return out

    def lost_lines(self) -> list[str]:
        """Every generation's log holds its ticker's lines 0, 1, 2, ... once each, in order."""
        out = []
        for d in sorted((self.v.state_dir / "logs").glob("*/")):
            files: dict[str, list[Path]] = defaultdict(list)
            for f in d.glob("g*.log*"):
                files[f.name.split(".log")[0]].append(f)
            for gen, parts in sorted(files.items()):
                # oldest first: g7.log.2, g7.log.1, g7.log
                parts.sort(key=lambda f: -int(f.suffix[1:]) if f.suffix != ".log" else 0)
                out += _gaps(f"{d.name} {gen}", parts)
        return out


def _instant(at: object) -> datetime:
    """A scheduled instant as naive UTC, whether the store's (a datetime, or SQLite's text)
    or the run's VIGIL_SCHEDULED_AT (ISO 8601 with +00:00)."""
    t = at if isinstance(at, datetime) else datetime.fromisoformat(str(at).replace(" ", "T"))
    return t.replace(tzinfo=None)


def _gaps(label: str, parts: list[Path]) -> list[str]:
    want = 0
    out = []
    for f in parts:
        for line in f.read_text(errors="replace").splitlines():
            m = TICK.search(line)
            if m is None:
                continue
            n = int(m[1])
            if n != want:
                out.append(f"{label}: tick {n} where tick {want} was due "
                           f"({'lost ' + str(n - want) if n > want else 'repeated'})")
            want = n + 1
    return out
