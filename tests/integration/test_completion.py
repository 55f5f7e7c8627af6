"""Shell completion (`vigil completion bash|zsh|fish`, click's own): commands, options, host
names and generation numbers from the store, each completion a real process driven through
click's environment variables, on the light path (no SQLAlchemy, no models imported)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, Vigil


def complete(v: Vigil, words: str, shell: str = "bash") -> tuple[list[str], set[str]]:
    """What `vigil` offers for the last word of `words` (bash: COMP_CWORD indexes it), and
    every module that completion imported (-X importtime)."""
    parts = words.split(" ")
    env = {**v.env, "_VIGIL_COMPLETE": f"{shell}_complete", "COMP_WORDS": words,
           "COMP_CWORD": str(len(parts) - 1)}
    cp = subprocess.run([sys.executable, "-X", "importtime", "-m", "runners.cli"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert cp.returncode == 0, cp.stderr
    mods = {line.split("|")[-1].strip() for line in cp.stderr.splitlines()
            if line.startswith("import time:")}
    offered = [line.split(",", 1)[1] for line in cp.stdout.splitlines() if "," in line]
    return offered, mods


def heavy(mods: set[str]) -> set[str]:
    return {m for m in mods if m.split(".")[0] == "sqlalchemy" or m.startswith(
        ("models.tables", "models.store", "workflows.config", "runners.quick.ops"))}


def test_bash_completes_hosts_commands_options_and_generations_without_sqlalchemy(
        vigil: Vigil) -> None:
    for name in ("web1", "web2", "worker", "api"):
        vigil.add_host(name)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web1", "--wait")
    gen = vigil.status("web1")["generation"]

    offered, mods = complete(vigil, "vigil wake we")
    assert offered == ["web1", "web2"], offered  # hosts starting with `we`, not worker or api
    assert "sqlite3" in mods or "psycopg" in mods  # read from the store itself...
    assert not heavy(mods), heavy(mods)  # ...on the light path

    assert complete(vigil, "vigil stop web1 w")[0] == ["web2", "worker"]  # not twice
    assert complete(vigil, "vigil host add w")[0] == []  # a new name: nothing to offer
    assert complete(vigil, "vigil host show a")[0] == ["api"]
    offered, mods = complete(vigil, "vigil logs web1 --generation ")
    assert offered == [str(gen)] and not heavy(mods), (offered, heavy(mods))
    assert complete(vigil, "vigil to")[0] == ["top"]
    assert "--interval" in complete(vigil, "vigil top --")[0]
    assert "--wait" in complete(vigil, "vigil wake web1 --")[0]
    vigil.run("stop", "web1", "--wait")


def test_a_missing_store_completes_nothing_quietly(vigil: Vigil) -> None:
    offered, _ = complete(vigil, "vigil --state-dir /nonexistent/vg wake w")
    assert offered == []


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_shell_s_code(shell: str) -> None:
    cp = subprocess.run([sys.executable, "-m", "runners.cli", "completion", shell],
                        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "_VIGIL_COMPLETE" in cp.stdout and f"{shell}_complete" in cp.stdout
    if shell == "bash" and shutil.which("bash"):  # the code loads and registers itself
        probe = subprocess.run(["bash", "-c", f"{cp.stdout}\ncomplete -p vigil"],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0 and "vigil" in probe.stdout, probe.stderr
    bad = subprocess.run([sys.executable, "-m", "runners.cli", "completion", "tcsh"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "tcsh" in bad.stderr and not bad.stdout
