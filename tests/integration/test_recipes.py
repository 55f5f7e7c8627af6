"""The recipes of examples/ for app servers nobody here wrote (issue 22), each as its
README or its `serve` says to add it: on a TCP port vigil holds, `--ready http` on the
generation's own $VIGIL_SOCKET (gunicorn alone sends READY=1: the default notify), through
overlap and hold deploys under a closed-loop client, with no request refused or timed out
and the server's own drops at its stop bounded as the guide says."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, Vigil
from tests.listening import Client, free_port, serving_inode

pytestmark = pytest.mark.timeout(600)
BIN = Path(sys.executable).parent
RECIPES = {  # the server's directory: its env (the binary from the test extra), its --ready
    "gunicorn": ({"GUNICORN": str(BIN / "gunicorn")}, "notify"),
    "hypercorn": ({"HYPERCORN": str(BIN / "hypercorn")}, "http"),
    "uvicorn": ({"PYTHON": sys.executable}, "http"),
    "waitress": ({"PYTHON": sys.executable}, "http"),
    "node": ({"NODE": shutil.which("node") or "node"}, "http"),  # Debian's nodejs (.ci/run)
}
DEPLOYS = 3  # of each mode
# At its graceful stop each of these servers may drop a connection it had just accepted:
# closed unanswered (b'') or, with the request unread, reset. Seen on this 2-core box under
# load: hypercorn 0.18 0-2 and uvicorn 0.54 0-1 of ~500-680 requests through 6 deploys, node
# and gunicorn none. A fault of the server's own, said in docs/guides/listeners.md: bounded
# here, never hidden, and a refusal or a timeout (what vigil's held socket prevents) is
# never allowed.
DROPPED_AT_STOP = ("answer b''", "ConnectionResetError")
# waitress has no graceful stop (SIGTERM ends it at once): each stop may drop the one
# request the closed-loop client has in flight, so at most one per deploy, same kinds
# (seen: 0-1 of 170-280 requests through 6 deploys).
NO_GRACEFUL_STOP = {"waitress"}
# hypercorn 0.18 logs the connection task it cancels at the end of its stop (the one it
# drops, above) as an asyncio traceback through its own tcp_server, ending in CancelledError
# (seen once in CI's PostgreSQL run, beside its one dropped request): its own, so allowed
# for hypercorn alone, never more of them than drops, and any other traceback still fails.
OWN_STOP_TRACEBACK = {"hypercorn": ("hypercorn/asyncio/tcp_server.py", "CancelledError")}


def tracebacks(logs: str) -> list[str]:
    """Each traceback in `vigil logs` output, as its lines (without the generation prefix)
    from `Traceback` to the exception line that ends it."""
    found: list[str] = []
    block: list[str] | None = None
    for line in logs.splitlines():
        text = line.split(" | ", 1)[-1]
        if text.startswith("Traceback"):
            block = [text]
        elif block is not None:
            block.append(text)
            if not text.startswith(" "):
                found.append("\n".join(block))
                block = None
    return found + (["\n".join(block)] if block else [])


def foreign_tracebacks(logs: str, server: str, drops: int) -> list[str]:
    """The tracebacks a server's known stop noise does not explain."""
    where, ending = OWN_STOP_TRACEBACK.get(server, ("", ""))
    own = [t for t in tracebacks(logs) if where and where in t and t.endswith(ending)]
    other = [t for t in tracebacks(logs) if t not in own]
    return other + own[drops:]


def builds(tmp: Path, server: str) -> list[Path]:
    out = []
    for label in ("a", "b"):
        p = tmp / f"{server}-{label}"
        p.write_bytes((ROOT / "examples" / server / "serve").read_bytes() + f"# {label}\n".encode())
        p.chmod(0o755)
        out.append(p)
    return out


@pytest.mark.parametrize("server", sorted(RECIPES))
def test_recipe_deploys_fail_no_request(vigil: Vigil, short_tmp: Path, server: str) -> None:
    if server == "node":
        if shutil.which("node") is None:
            pytest.skip("no node on PATH (Debian: apt-get install nodejs)")
    else:
        pytest.importorskip(server)
    port = free_port()
    two = builds(short_tmp, server)
    server_env, ready = RECIPES[server]
    env = [a for k, v in server_env.items() for a in ("--env", f"{k}={v}")]
    vigil.run("host", "add", "web", "--build", str(two[0]), "--cwd",
              str(ROOT / "examples" / server), "--listen", f"http=tcp:127.0.0.1:{port}",
              "--ready", ready, *env, "--health-timeout", "30")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait", timeout=60)
    inode = serving_inode(vigil, "web")
    with Client(port) as client:
        for i, mode in enumerate(["overlap", "hold"] * DEPLOYS):
            cp = vigil.run("deploy", "web", str(two[(i + 1) % 2]), "--mode", mode, "--wait",
                           timeout=120)
            assert f"done (mode {mode}, executed true" in cp.stdout, cp.stdout
            assert serving_inode(vigil, "web") == inode
    print(f"\n{server}: {client.ok} answered through {2 * DEPLOYS} deploys, "
          f"{len(client.failures)} failed")
    assert all(f.startswith(DROPPED_AT_STOP) for f in client.failures), client.failures[:5]
    bound = 2 * DEPLOYS if server in NO_GRACEFUL_STOP else max(2, client.ok // 100)
    assert len(client.failures) <= bound, client.failures[:5]
    assert client.ok > 2 * DEPLOYS and len(client.pids) >= 2
    logs = vigil.run("logs", "web", "-n", "100000", check=False).stdout
    assert "BrokenPipeError" not in logs, logs[-2000:]
    assert not foreign_tracebacks(logs, server, len(client.failures)), logs[-2000:]
    vigil.quiesce(30)
    vigil.check()
