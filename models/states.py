"""Every state column's Enum and the one table of transitions each allows."""

from __future__ import annotations

import enum


class HostKind(str, enum.Enum):
    instance = "instance"  # serves HTTP on a unix socket
    worker = "worker"  # serves nothing


class Desired(str, enum.Enum):
    up = "up"
    down = "down"


class GenState(str, enum.Enum):
    spawning = "spawning"  # intent written; the build may or may not have been exec'd
    running = "running"  # leader pid + create_time recorded; not serving yet
    current = "current"  # serves the host (at most one per host: partial unique index)
    retiring = "retiring"  # being ended (stop, drain, abandoned spawn, failed wake)
    proven = "proven"  # leader exited and containment empty: nothing of it is left


class WakeState(str, enum.Enum):
    queued = "queued"
    leased = "leased"  # lease acquired, fence recorded on the row
    spawning = "spawning"  # generation intent written (write-ahead of exec)
    checking = "checking"  # pid recorded, health being checked
    reaping = "reaping"  # interrupted by a crash: its generation is being ended, then retried
    unproven = "unproven"  # failed and its processes are not proven gone: keeps the lease
    done = "done"
    failed = "failed"
    cancelled = "cancelled"


class StopState(str, enum.Enum):
    queued = "queued"
    signalled = "signalled"  # generation and fence recorded; TERM/KILL/proof in progress
    done = "done"
    cancelled = "cancelled"


class ReloadState(str, enum.Enum):
    queued = "queued"
    signalled = "signalled"  # fence recorded; the reload signal sent (again after a crash)
    done = "done"  # back ready
    failed = "failed"  # not back ready within the health timeout: answered (restart or keep)
    cancelled = "cancelled"  # a stop, a deploy or an exit took over the generation


class RunState(str, enum.Enum):
    """A job's run (workflows/lifecycle/jobs.py): one row per scheduled instant."""

    due = "due"  # written with its wake (the intent) before anything of it is exec'd
    running = "running"  # its generation is current (pid recorded, or adopted after a crash)
    done = "done"  # exited 0
    failed = "failed"  # exited non-zero, or by a signal, or its start failed
    skipped = "skipped"  # due while the last run still ran (overlap skip): never started
    interrupted = "interrupted"  # the agent died before its pid was written: reaped, not run again
    queued = "queued"  # due while the run before it still runs (overlap queue): starts after it (0041)
    missed = "missed"  # passed while no agent ran, not run by the catch-up policy (0041)


class AttemptStep(str, enum.Enum):
    queued = "queued"
    admitted = "admitted"  # successor registered as a member (overlap) / mode decided
    raised = "raised"  # parent limit raised (or nothing to raise)
    published = "published"  # build written as referenced
    spawning = "spawning"  # successor generation intent written
    spawned = "spawned"  # successor pid recorded
    healthy = "healthy"
    settled = "settled"
    stopping_old = "stopping_old"  # hold mode: the old current is being stopped
    switched = "switched"  # successor is current; old one retiring
    drained = "drained"  # retiring generation proven
    ended = "ended"


class Outcome(str, enum.Enum):
    done = "done"
    failed = "failed"  # the build's own fault
    abandoned = "abandoned"  # stale: gate refused (superseded, lease lost, digest...)
    cancelled = "cancelled"  # the attempt's lifecycle ended it (stop, shutdown)
    down = "down"  # hold swap whose new build failed: the host is down


class MemberRole(str, enum.Enum):
    spawning = "spawning"
    successor = "successor"
    retiring = "retiring"


class Mode(str, enum.Enum):
    overlap = "overlap"
    hold = "hold"


class ListenerState(str, enum.Enum):
    new = "new"  # declared; never opened on this box (or reopened by the operator)
    opening = "opening"  # intent written: the socket may be bound, and may be in the holder
    held = "held"  # open, with its inode recorded; kept by the fd holder between generations
    lost = "lost"  # was held, and neither the holder nor any live process has it any more


class Cause(str, enum.Enum):
    release = "release"
    retry = "retry"
    restart = "restart"
    config = "config"
    rollout = "rollout"  # one wave of a rollout (workflows/rollouts/driver.py), or its revert
    resumed = "resumed"  # an attempt interrupted before its switch, written again (resumed_from)


class RolloutState(str, enum.Enum):
    running = "running"  # waves are admitted one after another as each settles
    paused = "paused"  # by the operator: the wave in flight settles, no new one starts
    halted = "halted"  # more hosts failed than allowed: no new wave; the one in flight settles
    reverting = "reverting"  # halted with --auto-revert: moved hosts go back to their builds
    aborting = "aborting"  # by the operator: what is in flight settles, then it ends
    ended = "ended"  # outcome written


class TryOutcome(str, enum.Enum):
    """How one try at delivering a notification ended (NULL while it is in flight)."""

    delivered = "delivered"  # the command exited 0, or the webhook answered 2xx
    failed = "failed"  # any other exit status or HTTP status, or it could not be sent
    timeout = "timeout"  # it ran past the notifier's timeout: killed, or the POST given up
    interrupted = "interrupted"  # the agent ended mid-try: it may have reached the receiver


class RolloutOutcome(str, enum.Enum):
    done = "done"  # every wave settled within --max-failures
    halted = "halted"  # stopped by failures, nothing reverted
    reverted = "reverted"  # stopped by failures, moved hosts deployed back
    aborted = "aborted"  # stopped by the operator


class TargetState(str, enum.Enum):
    pending = "pending"  # its wave has not started
    deploying = "deploying"  # its wave's attempt is written (attempt_id)
    done = "done"  # moved to the rollout's build
    failed = "failed"  # the build failed there: held down on that host
    abandoned = "abandoned"  # superseded there (a stop, a newer deploy or rollout), or given up
    skipped = "skipped"  # never deployed: held down, already on the build, or the rollout ended first
    reverting = "reverting"  # its revert attempt is written (revert_attempt_id)
    reverted = "reverted"  # back on the build it ran before the rollout
    revert_failed = "revert_failed"  # the revert attempt did not end done


TRANSITIONS: dict[type[enum.Enum], dict[enum.Enum, frozenset[enum.Enum]]] = {
    RunState: {
        RunState.due: frozenset({RunState.running, RunState.done, RunState.failed,
                                 RunState.interrupted}),
        # running -> due: a failed try started again (--retries), same row, its next wake
        RunState.running: frozenset({RunState.done, RunState.failed, RunState.due}),
        RunState.done: frozenset(),
        RunState.failed: frozenset(),
        RunState.skipped: frozenset(),
        RunState.interrupted: frozenset(),
        RunState.queued: frozenset({RunState.due, RunState.failed, RunState.interrupted}),
        RunState.missed: frozenset(),
    },
    GenState: {
        # spawning -> current: a worker's pid and its being current in one commit
        GenState.spawning: frozenset({GenState.running, GenState.current, GenState.retiring}),
        GenState.running: frozenset({GenState.current, GenState.retiring}),
        GenState.current: frozenset({GenState.retiring}),
        GenState.retiring: frozenset({GenState.proven}),
        GenState.proven: frozenset(),
    },
    WakeState: {
        # queued -> spawning: leased and its generation's intent written in one commit
        WakeState.queued: frozenset({WakeState.leased, WakeState.spawning, WakeState.done,
                                     WakeState.failed, WakeState.cancelled}),
        WakeState.leased: frozenset({WakeState.spawning, WakeState.cancelled, WakeState.failed}),
        # spawning -> done: a worker (no health check) current in the commit of its pid
        WakeState.spawning: frozenset(
            {WakeState.checking, WakeState.done, WakeState.unproven, WakeState.failed,
             WakeState.reaping}
        ),
        WakeState.checking: frozenset(
            {WakeState.done, WakeState.unproven, WakeState.failed, WakeState.reaping}
        ),
        WakeState.reaping: frozenset({WakeState.leased, WakeState.cancelled}),
        WakeState.unproven: frozenset({WakeState.failed}),
        WakeState.done: frozenset(),
        WakeState.failed: frozenset(),
        WakeState.cancelled: frozenset(),
    },
    AttemptStep: {
        AttemptStep.queued: frozenset({AttemptStep.admitted, AttemptStep.ended}),
        AttemptStep.admitted: frozenset({AttemptStep.raised, AttemptStep.stopping_old, AttemptStep.ended}),
        AttemptStep.raised: frozenset({AttemptStep.published, AttemptStep.ended}),
        AttemptStep.published: frozenset({AttemptStep.spawning, AttemptStep.ended}),
        AttemptStep.spawning: frozenset({AttemptStep.spawned, AttemptStep.stopping_old, AttemptStep.ended}),
        AttemptStep.spawned: frozenset({AttemptStep.healthy, AttemptStep.stopping_old, AttemptStep.ended}),
        AttemptStep.healthy: frozenset({AttemptStep.settled, AttemptStep.switched, AttemptStep.stopping_old,
                                        AttemptStep.ended}),
        AttemptStep.settled: frozenset({AttemptStep.switched, AttemptStep.stopping_old, AttemptStep.ended}),
        # hold: the old generation is proven gone, then the new build is published and spawned
        AttemptStep.stopping_old: frozenset({AttemptStep.published, AttemptStep.ended}),
        # overlap of a host of instances: drained, the next slot's successor is admitted
        AttemptStep.switched: frozenset({AttemptStep.drained, AttemptStep.admitted,
                                         AttemptStep.ended}),
        AttemptStep.drained: frozenset({AttemptStep.ended}),
        AttemptStep.ended: frozenset(),
    },
    MemberRole: {
        MemberRole.spawning: frozenset({MemberRole.successor, MemberRole.retiring}),
        MemberRole.successor: frozenset({MemberRole.retiring}),
        MemberRole.retiring: frozenset(),
    },
    Desired: {
        Desired.up: frozenset({Desired.down}),
        Desired.down: frozenset({Desired.up}),
    },
    ListenerState: {
        ListenerState.new: frozenset({ListenerState.opening}),
        ListenerState.opening: frozenset({ListenerState.held}),
        # held -> opening: bound again (the agent lacks it); -> lost: gone, or a new boot
        ListenerState.held: frozenset({ListenerState.opening, ListenerState.lost}),
        # lost -> opening: the host's next start binds it again; -> new: `vigil host reopen`
        ListenerState.lost: frozenset({ListenerState.opening, ListenerState.new}),
    },
    RolloutState: {
        RolloutState.running: frozenset({RolloutState.paused, RolloutState.halted,
                                         RolloutState.aborting, RolloutState.ended}),
        RolloutState.paused: frozenset({RolloutState.running, RolloutState.halted,
                                        RolloutState.aborting, RolloutState.ended}),
        RolloutState.halted: frozenset({RolloutState.reverting, RolloutState.aborting,
                                        RolloutState.ended}),
        RolloutState.reverting: frozenset({RolloutState.aborting, RolloutState.ended}),
        RolloutState.aborting: frozenset({RolloutState.ended}),
        RolloutState.ended: frozenset(),
    },
    TargetState: {
        TargetState.pending: frozenset({TargetState.deploying, TargetState.skipped,
                                        TargetState.abandoned}),
        TargetState.deploying: frozenset({TargetState.done, TargetState.failed,
                                          TargetState.abandoned, TargetState.skipped}),
        # A moved host is reverted, or left alone when something newer superseded it.
        TargetState.done: frozenset({TargetState.reverting, TargetState.abandoned}),
        TargetState.failed: frozenset({TargetState.reverting}),  # a hold that left it down
        TargetState.abandoned: frozenset(),
        TargetState.skipped: frozenset(),
        TargetState.reverting: frozenset({TargetState.reverted, TargetState.revert_failed,
                                          TargetState.abandoned}),
        TargetState.reverted: frozenset(),
        TargetState.revert_failed: frozenset(),
    },
    StopState: {
        StopState.queued: frozenset({StopState.signalled, StopState.done, StopState.cancelled}),
        StopState.signalled: frozenset({StopState.done}),
        StopState.done: frozenset(),
        StopState.cancelled: frozenset(),
    },
    ReloadState: {
        ReloadState.queued: frozenset({ReloadState.signalled, ReloadState.cancelled}),
        ReloadState.signalled: frozenset({ReloadState.done, ReloadState.failed,
                                          ReloadState.cancelled}),
        ReloadState.done: frozenset(),
        ReloadState.failed: frozenset(),
        ReloadState.cancelled: frozenset(),
    },
}

OPEN_RUN = (RunState.due, RunState.running)
# The runs still owed (pending_obligations, 0041): open, or queued behind the one that runs.
OWED_RUN = (RunState.due, RunState.running, RunState.queued)
OPEN_WAKE = (WakeState.queued, WakeState.leased, WakeState.spawning, WakeState.checking,
             WakeState.reaping, WakeState.unproven)
OPEN_STOP = (StopState.queued, StopState.signalled)
OPEN_RELOAD = (ReloadState.queued, ReloadState.signalled)
LIVE_GEN = (GenState.spawning, GenState.running, GenState.current, GenState.retiring)
OPEN_ROLLOUT = tuple(s for s in RolloutState if s is not RolloutState.ended)
IN_FLIGHT = (TargetState.deploying, TargetState.reverting)  # a target whose attempt is written


# Quick exits in a row (each within restart_reset of its start) that make a host crashloop.
CRASHLOOP_STREAK = 2


def allowed(old: enum.Enum, new: enum.Enum) -> bool:
    return new in TRANSITIONS[type(old)][old]
