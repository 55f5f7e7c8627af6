"""The `vigil` console script. `vigil --help` is answered here from a copy of the group's
help text (runners/help_text.py, kept equal to what click prints by a test), without
importing click or any command module: it costs about a bare interpreter's start. Every
other invocation is the CLI's (runners/cli)."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--help"]:
        from runners.help_text import HELP

        sys.stdout.write(HELP)
        return
    from runners.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
