"""Bad `--user`, `--group` and `--env-file` at `host add` and in the hosts file: one line
naming the cause and the fix, a non-zero exit, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from tests.conftest import FIXTURES, Vigil

WORKER = str(FIXTURES / "worker.py")


def refused(vigil: Vigil, *args: str) -> str:
    cp = vigil.run(*args, check=False)
    assert cp.returncode != 0, cp.stdout
    assert vigil.store.read(lambda s: s.execute(
        text("SELECT count(*) FROM hosts")).scalar()) == 0
    return cp.stderr.strip()


@pytest.mark.parametrize("extra,says", [
    (["--user", "no-such-user-x"], "no user 'no-such-user-x' in this box's passwd database"),
    (["--user", "root", "--group", "no-such-group-x"], "no group 'no-such-group-x'"),
    (["--group", "root"], "--group root without --user"),
    (["--env-file", "/nonexistent/app.env"], "env file /nonexistent/app.env does not exist"),
    (["--credential", "token"], "--credential 'token' is not NAME=PATH"),
    (["--credential", "token=/nonexistent/t"], "--credential token: /nonexistent/t: cannot read"),
    (["--credential", "a/b=/etc/hostname"], "'a/b' is not a credential name"),
])
def test_host_add_refuses_in_one_line(vigil: Vigil, extra: list[str], says: str) -> None:
    err = refused(vigil, "host", "add", "w", "--build", WORKER, "--kind", "worker", *extra)
    assert says in err and len(err.splitlines()) <= 2, err


def test_a_bad_env_file_line_is_named(vigil: Vigil, tmp_path: Path) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text("# fine\nGOOD=1\nthis is not an assignment\n")
    err = refused(vigil, "host", "add", "w", "--build", WORKER, "--kind", "worker",
                  "--env-file", str(bad))
    assert f"env file {bad}:3: the line is not NAME=value" in err, err
    assert "this is not an assignment" not in err, err  # the line may hold a secret


def test_an_optional_env_file_may_be_missing(vigil: Vigil) -> None:
    vigil.run("host", "add", "w", "--build", WORKER, "--kind", "worker",
              "--env-file", "-/nonexistent/app.env", "--user", "root")
    h = vigil.store.read(lambda s: s.execute(text(
        "SELECT run_user, env_files FROM hosts")).one())
    assert tuple(h) == ("root", '["-/nonexistent/app.env"]')


def test_the_hosts_file_checks_user_and_env_file(vigil: Vigil, tmp_path: Path) -> None:
    (tmp_path / "w.py").symlink_to(WORKER)
    f = tmp_path / "hosts.toml"
    f.write_text('[hosts.w]\nbuild = "w.py"\nkind = "worker"\nuser = "no-such-user-x"\n')
    err = refused(vigil, "apply", str(f))
    assert f"{f}:4: hosts.w.user: no user 'no-such-user-x'" in err, err
    (tmp_path / "app.env").write_text("A='open\n")
    f.write_text('[hosts.w]\nbuild = "w.py"\nkind = "worker"\nenv_file = "app.env"\n')
    err = refused(vigil, "apply", str(f))
    assert f"{f}:4: hosts.w.env_file: env file {tmp_path}/app.env:1: the ' opened here is " \
           "never closed" in err, err
    f.write_text('[hosts.w]\nbuild = "w.py"\nkind = "worker"\nuser = "root"\n'
                 'env_file = ["app.env", "-missing.env"]\n')
    (tmp_path / "app.env").write_text("A=1\n")
    vigil.run("apply", str(f))
    vigil.run("apply", str(f))  # applied twice: the second is a keep
    h = vigil.store.read(lambda s: s.execute(text(
        "SELECT run_user, env_files FROM hosts")).one())
    assert h[0] == "root" and "missing.env" in h[1]
