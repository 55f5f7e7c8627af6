"""Instances: N processes of one build on a host's held listeners, each a generation in its
own slot (workflows/generations/slots.py). Refused without listeners, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import HELLO, Vigil
from tests.integration.test_cli_bad_input import dump, refused
from tests.listening import free_port


def test_instances_without_listeners_are_refused_in_one_line(vigil: Vigil, tmp_path: Path) -> None:
    before = dump(vigil)
    cp = vigil.run("host", "add", "web", "--build", str(HELLO), "--instances", "2", check=False)
    refused(cp, "--instances 2 needs held listeners", "add --listen")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[hosts.web]\nbuild = "{HELLO}"\ninstances = 3\n')
    line = refused(vigil.run("apply", str(hosts), check=False), "instances 3 needs held listeners")
    assert f"{hosts}:3: hosts.web.instances" in line, line
    cp = vigil.run("host", "add", "web", "--build", str(HELLO), "--instances", "0",
                   "--listen", f"tcp:127.0.0.1:{free_port()}", check=False)
    refused(cp, "--instances must be a count from 1 to 64, not 0")
    assert dump(vigil) == before


@pytest.mark.parametrize("kind", ["worker"])
def test_a_worker_runs_one_instance(vigil: Vigil, kind: str) -> None:
    before = dump(vigil)
    cp = vigil.run("host", "add", "w", "--build", str(HELLO), "--kind", kind, "--instances", "2",
                   check=False)
    refused(cp, "a worker host runs one process")
    assert dump(vigil) == before
