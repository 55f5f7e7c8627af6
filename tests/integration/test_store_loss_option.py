"""`--on-store-loss fence|keep` (issue 28 item 4) carried end to end: `host add`, `host
set` (and `--unset`), the hosts file's `on_store_loss` key, `host show`; a bad value is
one line and writes nothing. What the agent does with it: tests/multibox/test_store_loss.py."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HELLO, Vigil
from tests.integration.test_cli_bad_input import refused


def loss(v: Vigil, name: str) -> str:
    return str(v.json("host", "show", name)["on_store_loss"])


def test_on_store_loss_is_carried_by_every_path(vigil: Vigil, short_tmp: Path) -> None:
    vigil.run("host", "add", "kept", "--build", str(HELLO), "--box", "a", "--box", "b",
              "--on-store-loss", "keep")
    vigil.run("host", "add", "plain", "--build", str(HELLO))
    assert (loss(vigil, "kept"), loss(vigil, "plain")) == ("keep", "fence")  # fence: the default
    assert "on store loss:      keep" in vigil.run("host", "show", "kept").stdout

    vigil.run("host", "set", "plain", "--on-store-loss", "keep")
    assert loss(vigil, "plain") == "keep"
    vigil.run("host", "set", "plain", "--unset", "on-store-loss")
    assert loss(vigil, "plain") == "fence"
    cp = vigil.run("host", "add", "bad", "--build", str(HELLO), "--on-store-loss", "maybe",
                   check=False)
    assert cp.returncode == 2 and "'maybe' is not one of 'fence', 'keep'" in cp.stderr, cp.stderr

    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.kept]\nbuild = "{HELLO}"\non_store_loss = "keep"\n'
                 f'[hosts.plain]\nbuild = "{HELLO}"\non_store_loss = "sometimes"\n')
    refused(vigil.run("apply", str(f), check=False),
            "hosts.toml:6: hosts.plain.on_store_loss", 'must be "fence" or "keep"')
    f.write_text(f'[hosts.kept]\nbuild = "{HELLO}"\n'  # left out: the default, fence
                 f'[hosts.plain]\nbuild = "{HELLO}"\non_store_loss = "keep"\n')
    out = vigil.run("apply", str(f)).stdout
    assert "on_store_loss" in out, out
    assert (loss(vigil, "kept"), loss(vigil, "plain")) == ("fence", "keep")
    assert sorted(h["host"] for h in vigil.json("host", "list")) == ["kept", "plain"]
