"""The agent's log lines: text stays key=value as the harness and operators read it; JSON
is one object a line with the key=value pairs as keys."""

from __future__ import annotations

import json
import logging
import sys

from runners.agent.agent_log import TEXT, JsonFormatter, split_message


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    return logging.LogRecord("vigil.agent", logging.WARNING, __file__, 1, msg, args, info)


def test_text_format_is_unchanged() -> None:
    line = logging.Formatter(TEXT).format(record("ready agent=%s", "a1"))
    assert line.startswith("ts=") and line.endswith(" level=WARNING logger=vigil.agent ready agent=a1")


def test_json_one_object_a_line_with_fields() -> None:
    line = JsonFormatter().format(record("drive kind=%s id=%s error=%r crashed", "attempt", 3,
                                         "Poke: a b"))
    d = json.loads(line)
    assert (d["level"], d["logger"], d["msg"]) == ("WARNING", "vigil.agent", "drive crashed")
    assert (d["kind"], d["id"], d["error"]) == ("attempt", "3", "Poke: a b")
    assert d["ts"].endswith("+00:00")
    tb = JsonFormatter().format(record("drive host=web crashed", exc=True))
    assert "\n" not in tb and "ValueError: boom" in json.loads(tb)["exc"]


def test_reserved_keys_do_not_overwrite() -> None:
    assert split_message("x msg=1 level=2") == ("x", {"field_msg": "1", "field_level": "2"})
