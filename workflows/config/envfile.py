"""Env files (`host add --env-file PATH`, `env_file` in the hosts file): systemd's
`EnvironmentFile=` syntax, read at each start of a generation, so a deploy or a restart
picks up a change. `--env` wins over every file; a later file wins over an earlier one.

The syntax, as systemd reads it:

- blank lines and lines starting with `#` or `;` are skipped; `export ` before a name is
  allowed (a file shared with a shell);
- `NAME=value`: the name is letters, digits and `_`, not starting with a digit; blanks
  around the name and before the value are dropped;
- unquoted, a backslash takes the next character as it is, a backslash at the end of the
  line joins the next line, and trailing blanks are dropped;
- 'single quotes' keep everything as written; "double quotes" take `\\"`, `\\\\`, `\\$` and
  `` \\` `` as that character (any other backslash stays), and a quoted value may span
  lines (its newlines kept); quoted and unquoted parts next to each other are joined.

A path starting with `-` names an optional file: missing, it is skipped (as systemd).
A file's values are never shown: not in status, events, logs nor a plan; only its path
is, and a bad line is named by its number, never by its text.
Reading the files is the runners' (runners/backend/envfiles.py): this module only parses.
"""

from __future__ import annotations

import re

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DQ_ESCAPES = '"\\$`'


class EnvFileError(ValueError):
    """A line that cannot be read: its number and why."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def optional(entry: str) -> tuple[str, bool]:
    """`-PATH` -> (PATH, True); `PATH` -> (PATH, False)."""
    return (entry[1:], True) if entry.startswith("-") else (entry, False)


def _value(lines: list[str], i: int, first: int, head: str) -> tuple[str, int]:
    """The value starting with `head` (lines[i] after its `=`): (value, index of the next
    line). `head` is passed, not spliced into a copy of `lines`: that copy per line made
    a file of n lines cost n² (a 1 MB file took minutes)."""
    out: list[str] = []
    quote: str | None = None
    text = head.lstrip()
    pending = ""  # unquoted blanks: kept only if more of the value follows
    while True:
        j = 0
        while j < len(text):
            c = text[j]
            if quote == "'":
                if c == "'":
                    quote = None
                else:
                    out.append(c)
            elif quote == '"':
                if c == '"':
                    quote = None
                elif c == "\\" and j + 1 < len(text) and text[j + 1] in _DQ_ESCAPES:
                    j += 1
                    out.append(text[j])
                elif c == "\\" and j + 1 == len(text):
                    break  # a backslash at the end of a quoted line: joined, no newline
                else:
                    out.append(c)
            elif c in " \t":
                pending += c
            else:
                out.append(pending)
                pending = ""
                if c in "'\"":
                    quote = c
                elif c == "\\":
                    if j + 1 == len(text):
                        break  # continuation
                    j += 1
                    out.append(text[j])
                else:
                    out.append(c)
            j += 1
        else:  # the line ended without a continuation backslash
            if quote is None:
                return "".join(out), i + 1
            out.append("\n")
        i += 1
        if i >= len(lines):
            if quote is not None:
                raise EnvFileError(first, f"the {quote} opened here is never closed")
            return "".join(out), i
        text = lines[i]


def parse(text: str) -> dict[str, str]:
    """Every assignment of an env file's text, in order. Raises EnvFileError."""
    lines = text.split("\n")
    out: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line or line[0] in "#;":
            i += 1
            continue
        if line.startswith("export") and line[6:7] in (" ", "\t"):
            line = line[7:].lstrip()
        name, sep, _ = line.partition("=")
        name = name.strip()
        # A bad line is named by number only: its text may be a value (`PASSWORD: s3cret`).
        if not sep:
            raise EnvFileError(i + 1, "the line is not NAME=value (its text is not shown)")
        if not NAME.fullmatch(name):
            raise EnvFileError(i + 1, "what comes before '=' is not a variable name (letters, "
                                      "digits and _, not starting with a digit; not shown)")
        if "\0" in lines[i]:
            raise EnvFileError(i + 1, f"{name} contains a NUL byte")
        rest = lines[i][lines[i].index("=") + 1:]
        value, i = _value(lines, i, i + 1, rest)
        out[name] = value
    return out
