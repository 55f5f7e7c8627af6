"""Frictions a new operator met (issue 14), each with the behaviour that replaced it: a
failed deploy is a WARNING in the agent's log with its reason, `retry` of a build that gc
removed is refused with the fix, unknown hosts are named as such, event lines say which
numbers are generations, and no help text cites a document outside the repository."""

from __future__ import annotations

import re

from runners.cli.output import event_line
from tests.conftest import FIXTURES, HELLO, Vigil


def test_failed_deploy_is_a_warning_with_its_reason_and_retry_of_a_removed_build_is_refused(
        vigil: Vigil) -> None:
    vigil.add_host("hello", HELLO, "--health-timeout", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    bad = FIXTURES / "bad_health.py"
    cp = vigil.run("deploy", "hello", str(bad), "--wait", check=False)
    assert cp.returncode == 1 and "attempt #1 failed" in cp.stderr
    assert "`vigil logs hello`" in cp.stderr  # the fix names a command, not a file path
    vigil.quiesce()
    log = vigil.agent_log().decode()
    warn = [ln for ln in log.splitlines() if "level=WARNING" in ln and "deploy_failed" in ln]
    assert len(warn) == 1, log[-3000:]
    assert "host=hello generation=g" in warn[0] and "attempt=1" in warn[0] and "health" in warn[0]

    assert "1 build(s) deleted" in vigil.run("gc").stdout  # the failed build, unreferenced now
    before = vigil.obligations()
    cp = vigil.run("retry", "hello", check=False)
    assert cp.returncode == 4, cp.stdout + cp.stderr
    assert cp.stderr.strip() == (
        f"vigil: error: the last failed build of hello ({_digest(vigil)}) is no longer staged "
        f"(`vigil gc` removed it); stage it again with `vigil deploy hello {bad}`")
    assert vigil.obligations() == before and "queued" not in cp.stdout


def _digest(vigil: Vigil) -> str:
    with vigil.store.engine.connect() as conn:
        return conn.exec_driver_sql("SELECT digest FROM attempts WHERE id = 1").scalar_one()[:12]


def test_unknown_hosts_are_named_in_every_command(vigil: Vigil) -> None:
    for args in (("wake", "nosuch"), ("stop", "nosuch"), ("status", "nosuch"),
                 ("deploy", "nosuch", str(HELLO)), ("retry", "nosuch"), ("events", "nosuch"),
                 ("logs", "nosuch"), ("host", "rm", "nosuch"), ("schedule", "rm", "nosuch"),
                 ("schedule", "add", "nosuch", "--cron", "* * * * *")):
        cp = vigil.run(*args, check=False)
        assert cp.returncode == 3 and "no host named 'nosuch'" in cp.stderr, (args, cp.stderr)


def test_a_mistyped_command_is_offered_the_near_names(vigil: Vigil) -> None:
    # The group loads a command's module only when asked for it: the names offered come from
    # every command, not only those loaded.
    cp = vigil.run("stauts", check=False)
    assert cp.returncode == 2 and "Did you mean one of: 'restart', 'status'?" in cp.stderr, cp.stderr


def test_event_lines_name_generations_and_row_ids() -> None:
    line = event_line({"id": 1, "at": "2026-12-01T08:00:00.000000Z", "host": "web",
                       "generation": 18, "kind": "switched",
                       "detail": {"attempt": 17, "retiring": 17}})
    assert line.endswith("web              g18   switched           attempt=#17 retiring=g17"), line


def test_no_help_text_cites_design() -> None:
    import click

    from runners.cli import cli

    def walk(cmd, path):  # type: ignore[no-untyped-def]
        yield path, cmd
        if isinstance(cmd, click.Group):  # the top group loads a command when asked for it
            with click.Context(cmd) as ctx:
                for name in cmd.list_commands(ctx):
                    yield from walk(cmd.get_command(ctx, name), [*path, name])

    from click.testing import CliRunner

    seen = 0
    for path, _ in walk(cli, []):
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert not re.search(r"DESIGN|§", result.output), (path, result.output)
        seen += 1
    assert seen > 25
