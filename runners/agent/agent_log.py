"""The agent's log: one line per event on stderr, key=value text (the default) or JSON.

Messages are written as `what key=value key=value ...`; the JSON form keeps `what` as `msg`
and turns each key=value pair into a key of the object, so journald and log shippers get
fields without parsing."""

from __future__ import annotations

import ast
import json
import logging
import re
import sys
from datetime import UTC, datetime

from runners.base.controls import escape_controls

TEXT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
# key=value where value is a quoted repr ('...' or "...") or runs to the next space.
PAIR = re.compile(r"""(?:^|\s)([A-Za-z_][\w.]*)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S*)""")
RESERVED = {"ts", "level", "logger", "msg"}


def split_message(message: str) -> tuple[str, dict[str, str]]:
    """`ready agent=a1 state_dir=/x` -> ("ready", {"agent": "a1", "state_dir": "/x"})."""
    fields: dict[str, str] = {}
    words = []
    pos = 0
    for m in PAIR.finditer(message):
        words.append(message[pos:m.start()])
        key = m.group(1)
        fields[f"field_{key}" if key in RESERVED else key] = _unquote(m.group(2))
        pos = m.end()
    words.append(message[pos:])
    return " ".join(" ".join(words).split()), fields


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        try:
            return str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            pass
    return value


class TextFormatter(logging.Formatter):
    """The key=value line with its control characters escaped: a value that came from an
    app (a STATUS= line, a path, an error's words) cannot put a raw ESC or a line of its own
    into the log. A traceback after the line keeps its own newlines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return escape_controls(super().formatMessage(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg, fields = split_message(record.getMessage())
        out = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "msg": msg, **fields}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str) -> None:
    """Root logging for `vigil agent`: text exactly as before, or one JSON object a line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
