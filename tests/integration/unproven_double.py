"""An unproven failed wake, made in-process: the real workflows, the real store and the
real process backend, except that the termination proof fails its first N reads (the one
fault that cannot be caused for real: a process that will not die under SIGKILL)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from models.store import Store
from models.tables import Wake
from runners.wiring import make_context, open_store
from tests.conftest import FIXTURES
from workflows.base.context import Context, Poke
from workflows.base.ports import ProcessPort, ProcRef
from workflows.lifecycle.wake import drive_wake, request_wake


class FlakyProof:
    """ProcessPort double: the real backend, but proven() answers False for its first
    `fails` calls (a proof that fails N times, then holds as the real one does)."""

    def __init__(self, real: ProcessPort, fails: int) -> None:
        self.real = real
        self.fails = fails
        self.calls = 0

    def proven(self, ref: ProcRef) -> bool:
        self.calls += 1
        if self.calls <= self.fails:
            return False
        return self.real.proven(ref)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@dataclass
class Unproven:
    ctx: Context
    proc: FlakyProof
    wake_id: int
    generation_id: int


@contextmanager
def in_process(vigil: Any, fails: int) -> Iterator[tuple[Context, FlakyProof]]:
    """A workflow Context on the harness's state dir whose proofs fail `fails` times.
    proof_wait=0: each drive reads the proof a fixed, small number of times (no polling)."""
    store: Store = open_store(vigil.state_dir, vigil.db_url)
    ctx = make_context(vigil.state_dir, store, "test-agent", proof_wait=0.0)
    proc = FlakyProof(ctx.proc, fails)
    ctx.proc = proc
    try:
        yield ctx, proc
    finally:
        store.dispose()


def leave_unproven_wake(ctx: Context, proc: FlakyProof, vigil: Any, host: str = "bad") -> Unproven:
    """Add a host whose build fails health, drive one wake of it: the wake fails, its
    process is SIGKILLed for real, but the (doubled) proof does not hold: `unproven`."""
    vigil.add_host(host, FIXTURES / "bad_health.py", "--health-timeout", "1")
    req = ctx.store.write(lambda s: request_wake(s, host))
    assert req.id is not None and req.state == "queued"
    with pytest.raises(Poke, match="not proven gone"):
        drive_wake(ctx, req.id)
    assert proc.calls >= 1
    w = ctx.store.read(lambda s: s.get(Wake, req.id))
    assert w.state.value == "unproven" and w.generation_id is not None, w
    return Unproven(ctx, proc, req.id, w.generation_id)
