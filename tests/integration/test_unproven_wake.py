"""A failed wake whose processes cannot be proven gone, in-process: the real
wake workflow, store and process backend, with only the proof doubled to fail N times.
The wake stays `unproven`, keeps the lease and refuses new wakes; the sweep retries the
proof with growing backoff until it holds, then gives the lease back."""

from __future__ import annotations

from datetime import timedelta

import pytest

from models.errors import Refused
from models.store import utcnow
from models.tables import Generation, Lease, Wake
from tests.conftest import Vigil, pid_dead, wait_for
from tests.integration.unproven_double import in_process, leave_unproven_wake
from workflows.base.context import Result
from workflows.engine.obligations import backoff, due, run_one
from workflows.lifecycle.wake import request_wake

FAILS = 8  # the first drive reads the proof twice, then each sweep twice: 3 fruitless sweeps


def test_unproven_wake_refuses_wakes_until_the_sweep_proves_it(vigil: Vigil) -> None:
    with in_process(vigil, FAILS) as (ctx, proc):
        u = leave_unproven_wake(ctx, proc, vigil)
        gen = u.generation_id

        # It keeps the lease and refuses every new wake, naming the generation.
        lease = ctx.store.read(lambda s: s.get(Lease, "bad"))
        assert lease is not None and lease.holder == "test-agent"
        with pytest.raises(Refused, match=rf"generation g{gen}\b.*not proven gone"):
            ctx.store.write(lambda s: request_wake(s, "bad"))
        assert vigil.status("bad")["state"] == "unproven"
        obligations = vigil.obligations()
        assert [(o["kind"], o["host"], o["generation"]) for o in obligations] == \
            [("unproven_wake", "bad", gen)], obligations
        # The process was SIGKILLed for real; only the proof (the double) disagrees.
        pid = ctx.store.read(lambda s: s.get(Generation, gen).pid)
        wait_for(lambda: pid_dead(pid), 5, what=f"pid {pid} to die")

        # The sweep: take the row from due() like the reconciler, drive it, read its pacing.
        pokes: list[tuple[int, float]] = []
        for _ in range(20):
            item = wait_for(lambda: [d for d in due(ctx, utcnow()) if d.id == u.wake_id], 5,
                            what="the unproven wake to fall due")[0]
            assert item.kind == "wake" and item.host == "bad"
            before = utcnow()
            result, error = run_one(ctx, item)
            after = utcnow()
            w = ctx.store.read(lambda s: s.get(Wake, u.wake_id))
            if result is not Result.poked:
                break
            assert w.state.value == "unproven" and "not proven gone" in (error or ""), (w, error)
            assert w.last_error == error
            wanted = backoff(w.attempts)
            assert before + timedelta(seconds=wanted) <= w.next_attempt_at <= \
                after + timedelta(seconds=wanted), (w.attempts, w.next_attempt_at, before, after)
            pokes.append((w.attempts, wanted))
            with pytest.raises(Refused):  # still refused while unproven
                ctx.store.write(lambda s: request_wake(s, "bad"))
        else:
            raise AssertionError("the proof never held")

        assert pokes[:3] == [(1, 0.1), (2, 0.2), (3, 0.4)], pokes
        assert result is Result.progress
        assert w.state.value == "failed" and w.ended_at is not None
        assert ctx.store.read(lambda s: s.get(Lease, "bad")) is None, "the lease must be given back"
        assert vigil.obligations() == []
        st = vigil.status("bad")
        assert st["state"] == "asleep" and st["lease"] is None
        vigil.check()

        # Proven: new wakes are accepted again.
        req = ctx.store.write(lambda s: request_wake(s, "bad"))
        assert req.id is not None and req.state == "queued"
