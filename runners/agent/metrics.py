"""Prometheus metrics for `vigil agent --metrics-listen HOST:PORT`.

What the store knows is read from the store at scrape time, in one read transaction, so it
is true across agent restarts and whichever agent did the work: open obligations by kind
and the oldest one's age, attempts by outcome, hosts by state, and the deploy and drain
duration histograms (from the attempt rows). What only this process sees is kept in memory
and starts from zero with it: reconciler round durations and failed termination proofs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from datetime import UTC
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from sqlalchemy import DateTime, column, func, select, table
from sqlalchemy.orm import Session

from models.errors import BadInput, Refused
from models.states import Outcome, RolloutOutcome, RolloutState
from models.store import Store, utcnow
from models.tables import Attempt, Event, Rollout
from workflows.config.hostrows import Facts, instance_status, state_of
from workflows.config.jobview import runs_by_result

log = logging.getLogger("vigil.metrics")
REGISTRY = CollectorRegistry()

ROUND = Histogram("vigil_reconciler_round_seconds",
                  "Time one reconciler round takes to pick due rows and hand them to drivers",
                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                  registry=REGISTRY)
PROOFS_FAILED = Counter("vigil_proofs_failed",
                        "Termination proofs that failed (processes not proven gone in time) "
                        "since this agent started", registry=REGISTRY)

OBLIGATION_KINDS = ("wake", "unproven_wake", "stop", "release", "restore", "attempt", "member",
                    "unproven_member", "rollout", "notification", "reload")
HOST_STATES = ("awake", "unhealthy", "asleep", "waking", "waiting", "crashloop", "deploying",
               "stopping", "retiring", "unproven", "down", "failed", "running", "scheduled")
DEPLOY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DRAIN_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_pending = table("pending_obligations", column("kind"), column("since", DateTime))


def parse_listen(value: str) -> tuple[str, int]:
    """`127.0.0.1:9108` or `[::1]:9108` -> (address, port)."""
    addr, sep, port = value.rpartition(":")
    addr = addr.removeprefix("[").removesuffix("]")
    if not sep or not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"--metrics-listen {value!r} is not ADDRESS:PORT",
                       "pass e.g. --metrics-listen 127.0.0.1:9108")
    return addr, int(port)


def serve(store: Store, listen: str) -> Any:
    """Start the HTTP endpoint (a daemon thread); the agent's Context counts its failed
    proofs in PROOFS_FAILED (runners/agent/daemon.py)."""
    addr, port = parse_listen(listen)
    REGISTRY.register(StoreCollector(store))
    try:
        server, _thread = start_http_server(port, addr, registry=REGISTRY)
    except OSError as exc:
        raise Refused(f"cannot serve metrics on {listen}: {exc.strerror or exc}",
                      "pass a free local ADDRESS:PORT to --metrics-listen") from None
    log.info("metrics listen=%s:%d path=/metrics", addr, port)
    return server


def _histogram(name: str, doc: str, values: Sequence[float],
               bounds: Sequence[float]) -> HistogramMetricFamily:
    buckets = [(str(b), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(sum(values)))


def _instances(slots: list[tuple[str, dict[str, Any]]]) -> Iterator[Metric]:
    """Each instance of a host of instances, as `vigil status` shows its slot."""
    up = GaugeMetricFamily("vigil_instance_up", "Each instance of a host of instances: 1 "
                           "while its slot has a current generation", labels=["host", "slot"])
    streaks = GaugeMetricFamily("vigil_instance_restart_streak", "Each instance's quick "
                                "exits in a row (its own backoff)", labels=["host", "slot"])
    for host, x in slots:
        up.add_metric([host, str(x["slot"])], 1 if x["generation"] else 0)
        streaks.add_metric([host, str(x["slot"])], x["restart_streak"])
    yield up
    yield streaks

def _jobs(success: dict[str, Any], runs: dict[tuple[str, str], int]) -> Iterator[Metric]:
    """Each job's last success (absent until its first run done) and its runs by result,
    as the store holds them (`vigil runs`): alert on `time() - vigil_job_last_success_timestamp`."""
    last = GaugeMetricFamily("vigil_job_last_success_timestamp", "When each job's last run "
                             "that exited 0 ended (Unix seconds)", labels=["host"])
    for host, at in sorted(success.items()):
        last.add_metric([host], at.replace(tzinfo=UTC).timestamp())
    yield last
    total = CounterMetricFamily("vigil_job_runs", "Each job's runs in the store by result: done, "
                                "failed, interrupted, skipped, missed (and due, queued, "
                                "running while open)", labels=["host", "result"])
    for (host, result), n in sorted(runs.items()):
        total.add_metric([host, result], n)
    yield total


class StoreCollector:
    """Reads the store on every scrape."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        snap = self.store.read(self._read)
        now = utcnow()

        open_ = GaugeMetricFamily("vigil_open_obligations", "Open obligations by kind",
                                  labels=["kind"])
        oldest = GaugeMetricFamily("vigil_oldest_obligation_age_seconds",
                                   "Age of the oldest open obligation of each kind (0 when none)",
                                   labels=["kind"])
        for kind in sorted(set(OBLIGATION_KINDS) | set(snap["obligations"])):
            count, since = snap["obligations"].get(kind, (0, None))
            open_.add_metric([kind], count)
            oldest.add_metric([kind], max(0.0, (now - since).total_seconds()) if since else 0.0)
        yield open_
        yield oldest

        attempts = CounterMetricFamily(
            "vigil_attempts", "Deploy attempts in the store by outcome ('open': not ended yet)",
            labels=["outcome"])
        for outcome in ["open", *(o.value for o in Outcome)]:
            attempts.add_metric([outcome], snap["attempts"].get(outcome, 0))
        yield attempts

        hosts = GaugeMetricFamily("vigil_hosts", "Hosts by state (as `vigil status` shows it)",
                                  labels=["state"])
        for state in sorted(set(HOST_STATES) | set(snap["hosts"])):
            hosts.add_metric([state], snap["hosts"].get(state, 0))
        yield hosts

        yield from _instances(snap["slots"])
        yield from _jobs(snap["job_success"], snap["job_runs"])

        rollouts = GaugeMetricFamily("vigil_rollouts", "Rollouts by state ('ended' for every "
                                     "rollout that has ended)", labels=["state"])
        for state in RolloutState:
            rollouts.add_metric([state.value], snap["rollouts"].get(state.value, 0))
        yield rollouts
        ended = GaugeMetricFamily("vigil_rollouts_ended", "Rollouts that have ended, by outcome",
                                  labels=["outcome"])
        for outcome in RolloutOutcome:
            ended.add_metric([outcome.value], snap["rollout_outcomes"].get(outcome.value, 0))
        yield ended

        exits = CounterMetricFamily(
            "vigil_app_exits", "Leaders of current generations that ended by themselves, in the "
            "store's history, by how ('exited 3', 'killed by SIGKILL', 'exited (status unknown)')",
            labels=["status"])
        for how, n in sorted(snap["exits"].items()):
            exits.add_metric([how], n)
        yield exits

        yield _histogram("vigil_deploy_duration_seconds",
                         "Attempt creation to end, for attempts that ran their build and are done",
                         snap["deploys"], DEPLOY_BUCKETS)
        yield _histogram("vigil_drain_duration_seconds",
                         "Time the retiring generation took to end, per swapped attempt",
                         snap["drains"], DRAIN_BUCKETS)

    @staticmethod
    def _read(s: Session) -> dict[str, Any]:
        obligations = {kind: (n, since) for kind, n, since in s.execute(
            select(_pending.c.kind, func.count(), func.min(_pending.c.since))
            .group_by(_pending.c.kind))}
        attempts = {(o.value if o is not None else "open"): n for o, n in s.execute(
            select(Attempt.outcome, func.count()).group_by(Attempt.outcome))}
        hosts: dict[str, int] = {}
        slots: list[tuple[str, dict[str, Any]]] = []  # each instance of a host of instances
        facts = Facts(s)  # every host's state in a few grouped reads, not a few per host
        for h in facts.hosts:
            state = state_of(facts, h)
            hosts[state] = hosts.get(state, 0) + 1
            slots += [(h.name, x) for x in
                      instance_status(facts, h, facts.currents(h.name)).get("slots", [])]
        # executed is false for a deploy to a sleeping host (it only set the next build):
        # no deploy duration for it.
        done = s.execute(select(Attempt.created_at, Attempt.ended_at, Attempt.drain_seconds,
                                Attempt.executed).where(Attempt.outcome == Outcome.done)).all()
        deploys = [(ended - created).total_seconds() for created, ended, _, executed in done
                   if ended is not None and executed]
        drains = [d for _, _, d, _ in done if d is not None]
        rollouts: dict[str, int] = {}
        outcomes: dict[str, int] = {}
        for state, outcome, n in s.execute(select(Rollout.state, Rollout.outcome, func.count())
                                           .group_by(Rollout.state, Rollout.outcome)):
            rollouts[state.value] = rollouts.get(state.value, 0) + n
            if outcome is not None:
                outcomes[outcome.value] = outcomes.get(outcome.value, 0) + n
        exits: dict[str, int] = {}
        for detail in s.execute(select(Event.detail).where(
                Event.kind == "exited", Event.detail.contains('"status": '))).scalars():
            how = json.loads(detail)["status"]
            exits[how] = exits.get(how, 0) + 1
        return {"obligations": obligations, "attempts": attempts, "hosts": hosts, "exits": exits,
                "deploys": deploys, "drains": drains, "rollouts": rollouts,
                "rollout_outcomes": outcomes, "slots": slots,
                "job_success": facts.jobs.success, "job_runs": runs_by_result(s)}
