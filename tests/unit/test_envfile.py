"""The env file parser: systemd's EnvironmentFile= syntax, bad lines named by number."""

from __future__ import annotations

import pytest

from workflows.config.envfile import EnvFileError, optional, parse


def test_comments_export_quotes_escapes_and_continuations() -> None:
    text = ("# a comment\n; another\n\nexport A=1\n  B = \"two words\"  \n"
            "C='kept $as \\\\ written'\nD=un\\ quoted\\\njoined\n"
            "E=\"spans\nlines \\\"q\\\" \\$HOME \\x\"\nF=foo \"bar\" baz   \nG=\n")
    assert parse(text) == {"A": "1", "B": "two words", "C": "kept $as \\\\ written",
                           "D": "un quotedjoined", "E": 'spans\nlines "q" $HOME \\x',
                           "F": "foo bar baz", "G": ""}


def test_a_later_assignment_wins() -> None:
    assert parse("A=1\nA=2\n") == {"A": "2"}


@pytest.mark.parametrize("text,line,says", [
    ("A=1\nnot an assignment\n", 2, "is not NAME=value"),
    ("1A=2\n", 1, "is not a variable name"),
    ("A=1\nB=\"open\nC=2\n", 2, "never closed"),
    ("A=\0\n", 1, "NUL"),
])
def test_a_bad_line_is_named(text: str, line: int, says: str) -> None:
    with pytest.raises(EnvFileError) as exc:
        parse(text)
    assert exc.value.line == line and says in exc.value.reason


def test_a_dash_makes_a_file_optional() -> None:
    assert optional("-/etc/a.env") == ("/etc/a.env", True)
    assert optional("/etc/a.env") == ("/etc/a.env", False)
