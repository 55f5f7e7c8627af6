"""Control characters an app (or anyone who names a thing) put in text that vigil prints:
shown escaped, never passed to a terminal or a log line as they are. An ESC sequence may
retitle a terminal, move its cursor, hide what follows or (on some terminals) send keys
back; a newline or carriage return inside a log message forges a line of its own."""

from __future__ import annotations

import re

# C0 but tab, DEL, C1; the line and paragraph separators; the bidi embeddings, overrides
# and isolates (text shown in another order than it is read).
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escaped(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(text: str) -> str:
    """`text` with each control character written as `\\xNN` (or `\\uNNNN`)."""
    return _CONTROLS.sub(_escaped, text)
