"""`vigil --help` as click prints it on an 80-column terminal (runners/entry.py prints it without
importing click). Written by `python -m runners.help_text --write`; a test keeps it equal."""

HELP = "Usage: vigil [OPTIONS] COMMAND [ARGS]...\n\n  vigil: a crash-safe process activator.\n\nOptions:\n  --version         Show the version and exit.\n  --state-dir TEXT  State directory (env VIGIL_HOME; default: the nearest\n                    .vigil in the current directory or above it, else\n                    ./.vigil).\n  --db TEXT         Database URL overriding the SQLite file in the state dir\n                    (env VIGIL_DB).\n  --listen-db TEXT  When --db is a pooler in transaction mode (PgBouncer): a\n                    direct URL of the PostgreSQL server, for the agent's\n                    LISTEN session (env VIGIL_LISTEN_DB).\n  --help            Show this message and exit.\n\nCommands:\n  agent        Run the agent in the foreground: recover, then keep every...\n  apply        Create, update and remove hosts to match a TOML file (see...\n  check        Exit 0 when every invariant holds (one current generation...\n  completion   The shell code that completes vigil's commands, options,...\n  crashpoints  Every registered crash point, one a line.\n  db           Schema: Alembic owns it.\n  deploy       Move a host to a new build (overlap: zero downtime; hold:...\n  events       Recent event rows, oldest first: time, host, generation,...\n  gc           Delete staged builds that no host, live generation or open...\n  host         Define the apps vigil runs.\n  import       Write a hosts file from a supervisord.conf, Procfile, PM2...\n  logs         The apps' output (stdout and stderr) in the order it was...\n  notify       Notifications of failures, delivered at least once (the...\n  obligations  Every open obligation (the pending_obligations view).\n  reload       Reload a host in place: its reload signal (HUP unless...\n  restart      Restart hosts on the build they run (HOST..., a glob such...\n  retry        Re-arm the host's last failed build: a new attempt with...\n  rollout      One build to many hosts in waves, halted (and reverted) on...\n  run          Start a run of a job now, outside its schedule (while one...\n  runs         A job's runs, newest scheduled instant first.\n  scale        Run N instances of a host on its held listeners: up wakes...\n  schedule     Scheduled restarts (cron, UTC), kept in the store; the...\n  shutdown     Stop every host, the agent, the held sockets and the...\n  signal       Send SIG (a name such as HUP, USR1 or SIGUSR2, or its...\n  status       Each host (or those named: names or globs such as 'web*'):...\n  stop         Stop hosts: each its stop signal (TERM unless set) or stop...\n  top          A live view of every host: state, generation, pid, up...\n  ui           A status page of hosts, open obligations, deploys and...\n  wake         Start hosts' current build (HOST..., a glob such as...\n"


def rendered() -> str:
    """What click prints for `vigil --help` on an 80-column terminal (78 of text)."""
    import click

    from runners.cli import cli

    with click.Context(cli, info_name="vigil", terminal_width=78) as ctx:
        return cli.get_help(ctx) + "\n"


if __name__ == "__main__":
    import pathlib
    import sys

    if sys.argv[1:] == ["--write"]:
        path = pathlib.Path(__file__)
        source = path.read_text()
        start = source.index("HELP = ")
        end = source.index("\n\n\ndef rendered")
        path.write_text(source[:start] + "HELP = " + repr(rendered()) + source[end:])
    else:
        sys.stdout.write(rendered())
