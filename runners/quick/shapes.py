"""What a control request must look like (runners/quick/control.py): its op and, per op, its
arguments and their types. A request that does not fit is answered with one line, `not a
vigil request: <why>`, before anything reads the store (a missing or mistyped field would
otherwise fail deep in an operation with a traceback)."""

from __future__ import annotations

import json
from typing import Any

MAX_REQUEST = 1 << 20  # bytes a line: a deploy's request is a few hundred

# op -> {field: (its types, required)}
_NAME: dict[str, tuple[tuple[type, ...], bool]] = {"name": ((str,), True)}
SHAPES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "hello": {},
    "agent": {},
    "obligations": {},
    "last_event": {},
    "names": {},
    "wake": _NAME,
    "stop": {**_NAME, "force": ((bool,), False)},
    "order": {"names": ((list,), True), "stop": ((bool,), False)},
    "retry": _NAME,
    "restart": {**_NAME, "mode": ((str,), False)},
    "status": {"name": ((str, type(None)), False)},
    "deploy": {**_NAME, "build": ((str,), True), "cwd": ((str,), True),
               "mode": ((str,), False), "canary": ((bool,), False), "cause": ((str,), False),
               "converge": ((bool,), False)},
    # changed_after: answered once the agent committed past that count (control.Commits)
    "progress": {"kind": ((str,), True), "id": ((int,), True), "after": ((int,), False),
                 "changed_after": ((int,), False)},
}


class NotARequest(Exception):
    """Why a line is not a vigil request (the words after `not a vigil request: `)."""


def parse(line: bytes) -> tuple[str, dict[str, Any], Any]:
    """(op, args, db) of one request line, or NotARequest saying what is wrong with it."""
    try:
        text = line.decode()
    except UnicodeDecodeError as exc:
        raise NotARequest(f"not UTF-8 (byte {exc.start})") from None
    try:
        req = json.loads(text)
    except RecursionError:  # the parser's own bound on nesting, long before the stack's
        raise NotARequest("nested too deeply") from None
    except ValueError as exc:
        raise NotARequest(f"not JSON ({exc})") from None
    if not isinstance(req, dict):
        raise NotARequest(f"a JSON {type(req).__name__}, not an object")
    op, args, db = req.get("op"), req.get("args") or {}, req.get("db")
    if not isinstance(op, str):
        raise NotARequest("no op (a string) in it")
    if op not in SHAPES:
        raise NotARequest(f"unknown op {op[:40]!r}")
    if not isinstance(args, dict):
        raise NotARequest(f"args of {op} is not an object")
    if db is not None and not isinstance(db, str):
        raise NotARequest("db is neither a URL nor null")
    for field, (types, required) in SHAPES[op].items():
        if field not in args:
            if required:
                raise NotARequest(f"{op} needs args.{field}")
            continue
        value = args[field]
        # bool is an int to isinstance: an id of `true` is not an id
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise NotARequest(f"args.{field} of {op} must be {names}")
    return op, args, db
