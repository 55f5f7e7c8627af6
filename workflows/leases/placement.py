"""Placement: which boxes may own a host when several boxes share one store.

A box is named by its agent id (`<state>/agent-id`, fixed on first start, or chosen with
`vigil agent --box NAME`). A host's placement is the list of boxes given to `vigil host add
--box BOX` (repeatable), stored comma-separated in `hosts.box`.

- No placement (the default, and every single-box store): any agent may take the host's
  lease while it is free, but nobody takes it over from another agent, even once expired.
- With a placement: only the boxes listed may take its lease, and a box listed takes it
  over from another agent whose lease has expired (workflows/lifecycle/takeover.py). Such a host is
  *contestable*: its owner self-fences (runners/agent/fencing.py) before its lease can expire,
  unless the host is `--on-store-loss keep`.
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
    """Could another box take this host over from `holder`?"""
    return bool(boxes(stored) - {holder})


# What a box does with a contestable host while it cannot reach the store (`--on-store-loss`).
FENCE = "fence"  # stopped before its lease can expire: it never runs on two boxes (the default)
KEEP = "keep"  # left running: no store outage stops it; a box cut off alone may run it twice
STORE_LOSS = (FENCE, KEEP)


def check_store_loss(value: str, label: str = "--on-store-loss ") -> str:
    if value not in STORE_LOSS:
        raise BadInput(f"{label}{value!r}: not fence or keep",
                       "write fence (stopped while the store cannot be reached, never on two "
                       "boxes) or keep (left running)")
    return value


def fenced(stored: str | None, holder: str, on_store_loss: str) -> bool:
    """Does `holder` self-fence this host (kill it before its lease can expire)?"""
    return contestable(stored, holder) and on_store_loss != KEEP


def kept(stored: str | None, holder: str, on_store_loss: str) -> bool:
    """A contestable host `holder` keeps running while the store cannot be reached."""
    return contestable(stored, holder) and on_store_loss == KEEP


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
