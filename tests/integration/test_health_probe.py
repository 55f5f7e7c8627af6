"""Issue 16 item 5: an app that stops serving while its process lives was shown awake and
`vigil check` passed. The ongoing probe (--health-interval, --unhealthy-after) says
unhealthy in status, events and check; --unhealthy-restart replaces the generation through
the ordinary obligations. Both fail before the probe existed (the options were unknown)."""

from __future__ import annotations

import pytest

from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

STOPS = FIXTURES / "stops_serving.py"


@pytest.fixture(params=["marker"])
def containment(request: pytest.FixtureRequest) -> str:
    return str(request.param)  # the probe does not depend on the containment


def kinds(vigil: Vigil, host: str) -> list[str]:
    return [e["kind"] for e in vigil.json("events", host)]


def test_an_app_that_stops_serving_is_unhealthy_and_check_says_so(vigil: Vigil) -> None:
    vigil.add_host("mute", STOPS, "--health-interval", "0.2", "--unhealthy-after", "2")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "mute", "--wait")
    wait_for(lambda: vigil.status("mute")["state"] == "unhealthy", 20, what="mute unhealthy")
    st = vigil.status("mute")
    assert st["health_failures"] >= 2 and st["unhealthy_since"], st
    assert not pid_dead(st["pid"]), "no restart without --unhealthy-restart"
    assert "unhealthy" in kinds(vigil, "mute")
    cp = vigil.run("check", check=False)
    assert cp.returncode != 0 and "healthy" in cp.stdout + cp.stderr, cp.stdout + cp.stderr
    vigil.run("stop", "mute", "--wait")
    vigil.quiesce(15)
    vigil.check()


def test_unhealthy_restart_replaces_the_generation(vigil: Vigil) -> None:
    vigil.add_host("mute", STOPS, "--health-interval", "0.2", "--unhealthy-after", "2",
                   "--unhealthy-restart", "--drain-timeout", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "mute", "--wait")
    first = vigil.status("mute")
    wait_for(lambda: (vigil.status("mute")["generation"] or first["generation"])
             > first["generation"], 30, what="a new generation of mute")
    wait_for(lambda: pid_dead(first["pid"]), 15, what="the unhealthy generation gone")
    events = vigil.json("events", "mute")
    assert any(e["kind"] == "exited" and e["generation"] == first["generation"]
               and "unhealthy" in e["detail"].get("reason", "") for e in events), events
    vigil.run("stop", "mute", "--wait")
    vigil.quiesce(15)
    vigil.check()


@pytest.mark.parametrize("args, says", [
    (("--kind", "worker", "--health-interval", "1"), "a worker serves none"),
    (("--unhealthy-after", "2"), "need a probe"),
    (("--health-interval", "0"), "--health-interval"),
    (("--health-interval", "1", "--unhealthy-after", "0"), "--unhealthy-after"),
])
def test_bad_probe_options_are_one_line_and_add_nothing(vigil: Vigil, args: tuple[str, ...],
                                                        says: str) -> None:
    cp = vigil.run("host", "add", "p", "--build", str(STOPS), *args, check=False)
    assert cp.returncode != 0 and says in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) <= 3, cp.stderr
    assert vigil.run("host", "list", "--json").stdout.strip() == "[]"


def test_apply_takes_the_probe_keys(vigil: Vigil, short_tmp) -> None:  # type: ignore[no-untyped-def]
    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.web]\nbuild = "{STOPS}"\nhealth_interval = 2\nunhealthy_after = 4\n')
    vigil.run("apply", str(f))
    st = vigil.status("web")
    assert (st["health_interval"], st["unhealthy_after"]) == (2.0, 4), st
    f.write_text(f'[hosts.job]\nbuild = "{STOPS}"\nkind = "worker"\nhealth_interval = 2\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and "hosts.toml:4: hosts.job.health_interval" in cp.stderr, cp.stderr
    assert vigil.status("web")["health_interval"] == 2.0  # nothing changed
