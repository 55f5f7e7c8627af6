"""Placement: which boxes may own a host when several boxes share one store.

A box is named by its agent id (`<state>/agent-id`, fixed on first start, or chosen with
`vigil agent --box NAME`). A host's placement is the list of boxes given to `vigil host add
--box BOX` (repeatable), stored comma-separated in `hosts.box`.

- No placement (the default, and every single-box store): any agent may take the host's
  lease while it is free, but nobody takes it over from another agent, even once expired.
- With a placement: only the boxes listed may take its lease, and a box listed takes it
  over from another agent whose lease has expired (workflows/lifecycle/takeover.py). Such a host is
  *contestable*: its owner self-fences (runners/agent/fencing.py) before its lease can expire.
"""

from __future__ import annotations

import re

from models.errors import BadInput

BOX = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_LEN = 255  # hosts.box is a String(255)


def check_box(name: str) -> None:
    if not BOX.fullmatch(name):
        raise BadInput(f"invalid box name {name!r}",
                       "use 1-63 characters: lowercase letters, digits, '.', '_' and '-'")


def encode(boxes: list[str] | tuple[str, ...]) -> str | None:
    """The stored form of a placement list (None: not placed)."""
    for b in boxes:
        check_box(b)
    value = ",".join(sorted(set(boxes))) or None
    if value is not None and len(value) > MAX_LEN:
        raise BadInput(f"placement {value!r} is longer than {MAX_LEN} characters",
                       "place the host on fewer boxes, or use shorter box names")
    return value


def boxes(stored: str | None) -> frozenset[str]:
    return frozenset(stored.split(",")) if stored else frozenset()


def may_hold(stored: str | None, agent_id: str) -> bool:
    """May this agent take the host's lease when it is free?"""
    return not stored or agent_id in boxes(stored)


def may_take_over(stored: str | None, agent_id: str) -> bool:
    """May this agent take the host over from another agent whose lease expired?"""
    return bool(stored) and agent_id in boxes(stored)


def contestable(stored: str | None, holder: str) -> bool:
    """Could another box take this host over from `holder`? Then `holder` self-fences."""
    return bool(boxes(stored) - {holder})


def can_meet(a: str | None, b: str | None) -> bool:
    """Could hosts placed `a` and `b` run on one box at once? Unplaced runs on any box."""
    return not a or not b or bool(boxes(a) & boxes(b))


def where_they_meet(a: str | None, b: str | None) -> str:
    """Words for a refusal: why two placements can meet (can_meet(a, b) holds)."""
    if not a and not b:
        return "neither is placed, so both may run on any box"
    if not a or not b:
        return f"one is placed nowhere, so it may run on {b or a} too"
    return "both are placed on " + ", ".join(sorted(boxes(a) & boxes(b)))
