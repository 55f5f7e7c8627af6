"""The two waivers of the lease fence that many steps share, each written once: a move that
carries no fence names why it needs none (models/transition.py `Unfenced`). Waivers that
only one module has stay beside it."""

from __future__ import annotations

from models.transition import Unfenced

# An operator's intent (vigil wake, stop, apply, host reopen, rollout pause|resume|abort):
# written by the CLI, before any lease exists to fence it.
OPERATOR = Unfenced("an operator's intent, written by the CLI before any lease")
# A row whose own state guards the move: a queued row has no fence yet, and the step that
# moves it further holds the host's lease (its gate checked it).
BY_STATE = Unfenced("the row's own state guards it; the step moving it holds the lease")
