"""Pacing: the one exponential backoff vigil waits out, tenacity's wait strategy:
`min(cap, floor * 2**(n - 1))` before try n. Obligations retry from 0.1 s doubling to 5 s;
a crash-looping app restarts with its host's own floor and cap."""

from __future__ import annotations

from tenacity import RetryCallState, Retrying, wait_exponential

ROW_FLOOR = 0.1  # an obligation's first retry
ROW_CAP = 5.0  # and its longest wait
_RETRYING = Retrying()  # only the carrier of the attempt number tenacity's strategy reads


def exponential(n: int, floor: float, cap: float) -> float:
    """The wait before try `n` (1 is the first retry): floor, 2*floor, 4*floor ... cap."""
    state = RetryCallState(retry_object=_RETRYING, fn=None, args=(), kwargs={})
    state.attempt_number = max(1, n)
    return float(wait_exponential(multiplier=floor, min=floor, max=cap)(state))


def backoff(attempts: int) -> float:
    """Delay before an obligation's next try after `attempts` fruitless ones: 0.1 ... 5 s."""
    return exponential(attempts, ROW_FLOOR, ROW_CAP)
