"""Zero-downtime under load: client threads hammer the canonical socket (a new unix-socket
connection per request) while 20 consecutive overlap deploys alternate two builds.

Asserted: zero failed requests, and every response comes from a generation that was current
(or the one before it) while the request was in flight, read against the `switched` events."""

from __future__ import annotations

import bisect
import hashlib
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

from sqlalchemy import select

from models.tables import Build, Event, Generation
from tests.conftest import HELLO, Vigil

DEPLOYS = 20
CLIENTS = 2
PACE = 0.01  # pause between one client's requests: load, not a CPU hog that starves the box
MAX_REQUESTS = 100_000  # bound in count ...
MAX_SECONDS = 90.0  # ... and in time (the deploys end well before; room for a loaded CI box)


@dataclass
class Sample:
    t0: float  # epoch seconds before connect()
    t1: float  # epoch seconds after the whole response was read
    ok: bool
    pid: int | None = None
    build: str | None = None
    error: str | None = None


def request(link: str) -> Sample:
    t0 = time.time()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(link)
        s.sendall(b"GET / HTTP/1.0\r\nHost: load\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    except OSError as exc:
        return Sample(t0, time.time(), False, error=f"{type(exc).__name__}: {exc}")
    finally:
        s.close()
    t1 = time.time()
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or status[1] != b"200":
        return Sample(t0, t1, False, error=f"bad answer {data[:80]!r}")
    fields = dict(part.split("=", 1) for part in body.decode().split() if "=" in part)
    try:
        return Sample(t0, t1, True, pid=int(fields["pid"]), build=fields["build"])
    except (KeyError, ValueError):
        return Sample(t0, t1, False, error=f"unparsable body {body[:80]!r}")


def prefix(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def test_twenty_overlap_deploys_under_load_fail_no_request(vigil: Vigil, short_tmp: Path) -> None:
    build_a = HELLO
    build_b = short_tmp / "hello.py"
    build_b.write_bytes(HELLO.read_bytes() + b"# build b: one extra comment line\n")
    build_b.chmod(0o755)
    labels = {prefix(build_a), prefix(build_b)}
    assert len(labels) == 2

    vigil.add_host("hello", build_a)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    first = vigil.status("hello")
    link = str(vigil.state_dir / "run" / "hello.sock")
    assert request(link).ok

    samples: list[list[Sample]] = [[] for _ in range(CLIENTS)]
    done = threading.Event()
    count = [0]
    count_lock = threading.Lock()
    started = time.monotonic()

    def client(out: list[Sample]) -> None:
        while not done.is_set() and time.monotonic() - started < MAX_SECONDS:
            with count_lock:
                if count[0] >= MAX_REQUESTS:
                    return
                count[0] += 1
            try:
                out.append(request(link))
            except BaseException as exc:  # never lose a failure to a dying thread
                out.append(Sample(time.time(), time.time(), False, error=repr(exc)))
            time.sleep(PACE)

    threads = [threading.Thread(target=client, args=(samples[i],), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    durations: list[float] = []
    try:
        for i in range(DEPLOYS):
            build = build_b if i % 2 == 0 else build_a
            t = time.monotonic()
            cp = vigil.run("deploy", "hello", str(build), "--wait", timeout=30)
            durations.append(time.monotonic() - t)
            assert "done (mode overlap, executed true" in cp.stdout, cp.stdout
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert not any(t.is_alive() for t in threads), "a client thread did not stop"
    elapsed = time.monotonic() - started

    flat = sorted((s for ss in samples for s in ss), key=lambda s: s.t0)
    failures = [s for s in flat if not s.ok]
    by_build: dict[str, int] = {}
    for s in flat:
        if s.build:
            by_build[s.build] = by_build.get(s.build, 0) + 1
    print(f"\nload: {len(flat)} requests in {elapsed:.1f}s by {CLIENTS} clients, "
          f"{len(failures)} failed; per build {by_build}")
    print(f"deploys: {len(durations)}, total {sum(durations):.1f}s, min {min(durations):.2f}s, "
          f"median {statistics.median(durations):.2f}s, max {max(durations):.2f}s")
    assert not failures, f"{len(failures)} failed requests, first: {failures[:5]}"

    # The store's own record: generations (pid -> id, build) and the switch times.
    def read(s):  # type: ignore[no-untyped-def]
        gens = {g.pid: (g.id, s.get(Build, g.build_id).digest[:12])
                for g in s.execute(select(Generation).where(Generation.host == "hello")).scalars()}
        switches = [(e.at.replace(tzinfo=UTC).timestamp(), e.generation_id)
                    for e in s.execute(select(Event).where(Event.host == "hello", Event.kind == "switched")
                                       .order_by(Event.id)).scalars()]
        swapped = [json.loads(e.detail)["drain_seconds"] for e in s.execute(
            select(Event).where(Event.host == "hello", Event.kind == "swapped")).scalars()]
        return gens, switches, swapped

    gens, switches, swapped = vigil.store.read(read)
    assert len(switches) == DEPLOYS and len(swapped) == DEPLOYS
    assert flat[-1].t0 > switches[-1][0], "the clients stopped before the last switch"
    print(f"drain seconds: max {max(swapped):.3f}, median {statistics.median(swapped):.3f}")
    order = [first["generation"]] + [g for _, g in switches]  # generation index = position
    index = {g: i for i, g in enumerate(order)}
    times = [t for t, _ in switches]

    def current_index(t: float) -> int:
        """Index of the generation the store had made current at epoch t (the link is
        repointed after the event row is written, so it may still show the one before)."""
        return bisect.bisect_right(times, t)

    for s in flat:
        assert s.pid in gens, f"response from pid {s.pid}, which is no generation of hello"
        gen_id, digest = gens[s.pid]
        assert s.build == digest and s.build in labels, (s, digest)
        i = index[gen_id]
        lo, hi = current_index(s.t0) - 1, current_index(s.t1)
        assert lo <= i <= hi, (f"g{gen_id} (index {i}) answered a request in flight "
                               f"{s.t0:.3f}-{s.t1:.3f}, when indexes {lo}..{hi} were current")

    # Monotone in generation order: once a response from generation n+2 was read, no request
    # started later is answered by generation n.
    by_end = sorted(flat, key=lambda s: s.t1)
    ends = [s.t1 for s in by_end]
    best = []
    top = -1
    for s in by_end:
        top = max(top, index[gens[s.pid][0]])
        best.append(top)
    for s in flat:
        k = bisect.bisect_left(ends, s.t0)  # responses completed strictly before s started
        if k:
            assert index[gens[s.pid][0]] >= best[k - 1] - 1, (
                f"pid {s.pid} answered after a response from two generations later")

    vigil.quiesce(15)
    vigil.check()
    st = vigil.status("hello")
    assert st["generation"] == order[-1] and vigil.app_pids() == [st["pid"]]
    assert agent.poll() is None
