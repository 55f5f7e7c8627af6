"""`vigil host show` and `vigil host set` through the CLI as typed (issue 22): every setting
read back, a setting changed without remove and add, applied at the next start, refused
with one line and nothing written when bad."""

from __future__ import annotations

import socket

from tests.conftest import FIXTURES, HELLO, Vigil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host_row(vigil: Vigil, name: str) -> dict[str, object]:
    from sqlalchemy import text

    with vigil.store.engine.connect() as conn:
        return dict(conn.execute(text("SELECT * FROM hosts WHERE name = :name"),
                                 {"name": name}).one()._mapping)


def test_host_show_names_every_setting_the_build_file_and_the_last_attempt(vigil: Vigil) -> None:
    port = _free_port()
    vigil.add_host("web", HELLO, "--listen", f"http=tcp:127.0.0.1:{port}", "--ready", "http",
                   "--env", "TOKEN=secret", "--drain-timeout", "3")
    out = vigil.run("host", "show", "web").stdout
    assert out.startswith("host web: instance, asleep (desired down)\n"), out
    assert "hello.py " in out and "(from " in out  # the file name beside its digest
    assert "drain timeout:      3.0" in out and "ready:              http" in out
    assert "env (names):        TOKEN" in out and "secret" not in out
    assert f"listener:           http=tcp:127.0.0.1:{port} (fd 3, new)" in out
    info = vigil.json("host", "show", "web")
    assert info["build"]["file"] == "hello.py" and len(info["build"]["digest"]) == 64
    assert info["last_attempt"] is None
    assert "hello.py " + info["build"]["digest"][:12] in vigil.run(
        "host", "list", env={"COLUMNS": "120"}).stdout
    assert vigil.status("web")["build_file"] == "hello.py"

    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    vigil.run("restart", "web", "--wait")
    info = vigil.json("host", "show", "web")
    assert info["state"] == "awake" and info["last_attempt"]["outcome"] == "done"
    assert info["last_attempt"]["cause"] == "restart"
    assert "last attempt:       #1 restart overlap of " in vigil.run("host", "show", "web").stdout
    cp = vigil.run("host", "show", "nosuch", check=False)
    assert cp.returncode == 3 and "no host named 'nosuch'" in cp.stderr


def test_host_set_changes_a_setting_at_the_next_start(vigil: Vigil) -> None:
    vigil.add_host("web", HELLO)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    gen = vigil.status("web")["generation"]
    cp = vigil.run("host", "set", "web", "--drain-timeout", "4", "--env", "A=1",
                   "--health-interval", "5")
    assert cp.stdout.startswith("~ update web: env {} -> {A}, drain_timeout 10.0 -> 4.0"), cp.stdout
    assert "takes effect at its next start" in cp.stdout
    row = _host_row(vigil, "web")
    assert row["drain_timeout"] == 4.0 and row["env"] == '{"A": "1"}'
    assert row["health_interval"] == 5.0
    assert vigil.status("web")["generation"] == gen  # not restarted by the change
    assert vigil.run("host", "set", "web", "--drain-timeout", "4").stdout == (
        "host web: nothing to change\n")
    vigil.run("host", "set", "web", "--unset", "health-interval", "--unset-env", "A")
    row = _host_row(vigil, "web")
    assert row["health_interval"] is None and row["env"] == "{}"

    new = vigil.state_dir.parent / "hello2.py"
    new.write_text(HELLO.read_text() + "# another build\n")
    new.chmod(0o755)
    cp = vigil.run("host", "set", "web", "--build", str(new))
    assert cp.stdout.startswith("~ deploy web: build ") and "(attempt #1)" in cp.stdout, cp.stdout


def test_host_set_refuses_bad_values_with_one_line_and_writes_nothing(vigil: Vigil) -> None:
    vigil.add_host("web", HELLO)
    vigil.add_host("job", FIXTURES / "worker.py", "--kind", "worker")
    before = _host_row(vigil, "web")
    port = _free_port()
    for args, line in (
            (("web", "--ready", "notify"), "--ready notify needs a shared listener"),
            (("web", "--one-shot"), "host set web: --one-shot: applies to workers only"),
            (("web", "--restart-cap", "0.5"), "restart_cap 0.5 is below restart_floor 1"),
            (("web", "--socket-mode", "0600"), "does not let the group read and write"),
            (("web", "--cwd", "/nonexistent"), "is not an existing directory"),
            (("job", "--listen", f"tcp:127.0.0.1:{port}"), "is for instances")):
        cp = vigil.run("host", "set", *args, check=False)
        assert cp.returncode == 2, (args, cp.stdout, cp.stderr)
        assert line in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, (args, cp.stderr)
    assert _host_row(vigil, "web") == before

    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    cp = vigil.run("host", "set", "web", "--kind", "worker", check=False)
    assert cp.returncode == 4 and "host web is awake: its kind cannot change while it runs" in cp.stderr
    assert _host_row(vigil, "web")["kind"] == "instance"
    cp = vigil.run("host", "set", "web", "--drain-timeout", "2", "--dry-run")
    assert "dry run: nothing changed" in cp.stdout and _host_row(vigil, "web")["drain_timeout"] == 10.0


def test_host_set_keeps_the_env_files_and_credentials_it_does_not_change(
        vigil: Vigil, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before: the stored JSON lists were read back as one path each (`host set x
    --drain-timeout 5` on a host with an env file said `env file .../["/x.env"] does not
    exist`)."""
    env_file, cred = tmp_path / "x.env", tmp_path / "token"
    env_file.write_text("A=1\n")
    cred.write_text("secret\n")
    vigil.add_host("x", HELLO, "--env-file", str(env_file), "--credential", f"tok={cred}")
    before = _host_row(vigil, "x")
    assert "update x: drain_timeout 10.0 -> 5.0" in vigil.run(
        "host", "set", "x", "--drain-timeout", "5").stdout
    after = _host_row(vigil, "x")
    assert (after["env_files"], after["credentials"]) == (before["env_files"], before["credentials"])


def test_host_add_of_an_existing_name_says_so_first(vigil: Vigil) -> None:
    """Before: a host holding a port, added again, was refused for the port in use (by
    vigil's own agent and holder). The name is checked first now."""
    port = _free_port()
    vigil.add_host("web", HELLO, "--listen", f"tcp:127.0.0.1:{port}")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    cp = vigil.run("host", "add", "web", "--build", str(HELLO), "--listen",
                   f"tcp:127.0.0.1:{port}", check=False)
    assert cp.returncode == 2
    assert cp.stderr.strip() == (
        "vigil: error: host web already exists; change it with `vigil host set web ...`, or "
        "remove it first with `vigil host rm web`"), cp.stderr


def test_a_host_added_again_starts_with_no_output(vigil: Vigil) -> None:
    """Before: `vigil logs` of a re-added host showed the removed host's lines as its own."""
    from tests.conftest import wait_for

    ticker = FIXTURES / "ticker.py"
    vigil.add_host("job", ticker, "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "job", "--wait")
    wait_for(lambda: "tick 0" in vigil.run("logs", "job").stdout, 20, what="the ticker's output")
    vigil.run("stop", "job", "--wait")
    vigil.quiesce()
    vigil.run("host", "rm", "job")
    vigil.add_host("job", ticker, "--kind", "worker")
    cp = vigil.run("logs", "job")
    assert cp.stdout == "" and "no output of job yet" in cp.stderr, cp.stdout[-500:]
    kept = list((vigil.state_dir / "logs" / ".removed").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("job-") and list(kept[0].glob("g*.log*"))
