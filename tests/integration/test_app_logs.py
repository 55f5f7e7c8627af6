"""No app's log gets a traceback from vigil's own probes (issue 22): a readiness or health
probe that read the status line and closed left `BrokenPipeError` in the log of every app
on Python's http.server, examples/hello among them. Overlap and hold deploys, the ongoing
probe every 0.2 s and a closed-loop client on the shared port, then every file of every
generation under the state dir's logs/ is read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import HELLO, ROOT, Vigil
from tests.listening import Client, free_port

pytestmark = pytest.mark.timeout(600)
DEPLOYS = 2  # of each mode: with the first start, 5 generations, all of whose logs are kept
SETUPS = {  # name: (build to copy, host add options), each with a closed-loop client or none
    "hello": (HELLO, []),  # its own socket: readiness and the ongoing probe only
    "hello-listen": (HELLO, ["--ready", "http"]),  # + the shared port, under load
    "waitress": (ROOT / "examples" / "waitress" / "serve",
                 ["--ready", "http", "--cwd", str(ROOT / "examples" / "waitress"),
                  "--env", f"PYTHON={sys.executable}"]),
}


def builds(tmp: Path, src: Path) -> list[Path]:
    out = []
    for label in ("a", "b"):
        p = tmp / f"{src.name}-{label}"
        p.write_bytes(src.read_bytes() + f"\n# {label}\n".encode())
        p.chmod(0o755)
        out.append(p)
    return out


def log_files(v: Vigil, host: str) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in sorted((v.state_dir / "logs" / host).glob("g*.log*"))}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_no_app_log_has_a_broken_pipe(vigil: Vigil, short_tmp: Path, setup: str) -> None:
    if setup == "waitress":
        pytest.importorskip("waitress")
    src, extra = SETUPS[setup]
    two = builds(short_tmp, src)
    port = free_port()
    listen = ["--listen", f"http=tcp:127.0.0.1:{port}"] if setup != "hello" else []
    vigil.run("host", "add", "web", "--build", str(two[0]), *listen, *extra,
              "--health-interval", "0.2", "--health-timeout", "30")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait", timeout=60)
    generations = {vigil.status("web")["generation"]}
    client = Client(port) if listen else None
    if client is not None:
        client.__enter__()
    try:
        for i, mode in enumerate(["overlap", "hold"] * DEPLOYS):
            cp = vigil.run("deploy", "web", str(two[(i + 1) % 2]), "--mode", mode, "--wait",
                           timeout=120)
            assert f"done (mode {mode}, executed true" in cp.stdout, cp.stdout
            st = vigil.status("web")
            assert st["health_interval"] == 0.2 and st["health_failures"] == 0, st
            generations.add(st["generation"])
    finally:
        if client is not None:
            client.__exit__()
    vigil.run("stop", "web", "--wait")
    vigil.quiesce(30)
    logs = log_files(vigil, "web")
    named = {int(p.name.split(".")[0][1:]) for p in logs}
    assert named == generations, (sorted(named), sorted(generations))  # every one read
    broken = {str(p): text[-1500:] for p, text in logs.items() if "BrokenPipeError" in text}
    assert not broken, broken
    if client is not None:
        assert client.ok > 4 * DEPLOYS, client.ok
    vigil.check()
