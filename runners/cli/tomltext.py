"""Where a hosts file's complaint points (runners/cli/hostfile.py): the line of a key in its
host's table (tomllib gives no line numbers for keys), and the nesting too deep for tomllib
to read without a RecursionError."""

from __future__ import annotations

import re

from models.errors import BadInput


def line_of(text: str, host: str | None, key: str | None) -> int:
    """1-based line of `key` in the table of `host` (or of the top-level `key`); the
    table's header when the key is not found; 1 when nothing is."""
    lines = text.splitlines()
    start, end = 0, len(lines)
    if host is not None:
        quoted = rf'(?:{re.escape(host)}|"{re.escape(host)}"|\'{re.escape(host)}\')'
        header = re.compile(rf"^\s*\[\s*hosts\s*\.\s*{quoted}\s*\]")
        inline = re.compile(rf"^\s*(?:hosts\s*\.\s*)?{quoted}\s*[=.]")
        found = next((i for i, ln in enumerate(lines) if header.match(ln)), None)
        if found is None:
            found = next((i for i, ln in enumerate(lines) if inline.match(ln)), None)
        if found is None:
            return 1
        start = found
        end = next((i for i in range(found + 1, len(lines)) if lines[i].lstrip().startswith("[")),
                   len(lines))
        if key is None:
            return start + 1
    if key is None:
        return 1
    pattern = re.compile(rf'(?:^|[{{,.\s]){re.escape(key)}\s*=|(?:^|[{{,\s])"{re.escape(key)}"\s*=')
    for i in range(start, end):
        if pattern.search(lines[i].split("#", 1)[0]):
            return i + 1
    return start + 1


MAX_NESTING = 32  # arrays and inline tables inside each other: no key needs more than 2
# Strings and comments (where a bracket is text), else one bracket or brace.
_TOKEN = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*'
                    r"|[\[\]{}]", re.DOTALL)


def too_deep(text: str) -> int | None:
    """The line where arrays and inline tables first nest deeper than MAX_NESTING, else
    None: tomllib reads them by recursion, and a file nested 100,000 deep would end in a
    RecursionError's traceback."""
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return text.count("\n", 0, m.start()) + 1
        elif c in "]}":
            depth = max(0, depth - 1)
    return None


def nested(path: str, line: int | None) -> BadInput:
    return BadInput(f"{path}{f':{line}' if line else ''}: arrays or inline tables nested more "
                    f"than {MAX_NESTING} deep", "no key of a hosts file nests more than 2: "
                    "correct the brackets")
