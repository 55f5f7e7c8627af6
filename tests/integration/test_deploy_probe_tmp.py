import os, signal, time
from tests.conftest import HELLO, FIXTURES, Vigil, pid_dead, wait_for
from tests.integration.test_deploy_outcomes import *

def test_stop_during_drain(vigil, short_tmp):
    old = awake(vigil, FIXTURES / "serve_ignore_term.py", "--drain-timeout", "3")
    aid = queued_id(vigil.run("deploy", "hello", str(HELLO)).stdout)
    wait_for(lambda: attempt(vigil, aid).step.value == "switched", 15)
    cp = vigil.run("stop", "hello", "--wait", timeout=60)
    a = attempt(vigil, aid)
    print("STOPDRAIN", a.outcome, a.reason, a.drain_seconds, cp.stdout)
    vigil.quiesce(20); vigil.check()
    assert vigil.app_pids() == []
    print(vigil.status("hello"))

def test_spawn_error(vigil, short_tmp):
    old = awake(vigil)
    bad = short_tmp / "noshebang"
    bad.write_text("echo hi\n"); bad.chmod(0o755)
    cp = vigil.run("deploy", "hello", str(bad), "--wait", check=False)
    print("SPAWNERR", cp.returncode, cp.stdout, cp.stderr)
    (a,) = attempts(vigil)
    print(a.outcome, a.executed, a.reason)
    vigil.quiesce(20); vigil.check()
    serves(vigil, "hello", old["pid"])

def test_retry_nothing(vigil):
    awake(vigil)
    cp = vigil.run("retry", "hello", check=False)
    print("RETRY", cp.returncode, repr(cp.stderr))

def test_hold_superseded_while_draining(vigil, short_tmp):
    old = awake(vigil, FIXTURES / "serve_ignore_term.py", "--drain-timeout", "2")
    b = variant(HELLO, short_tmp / "b.py", "b")
    first = queued_id(vigil.run("deploy", "hello", str(HELLO), "--mode", "hold").stdout)
    wait_for(lambda: attempt(vigil, first).step.value == "stopping_old", 15)
    second = queued_id(vigil.run("deploy", "hello", str(b)).stdout)
    wait_for(lambda: attempt(vigil, second).outcome is not None, 30)
    vigil.quiesce(20)
    for a in attempts(vigil): print("HOLDSUP", a.id, a.outcome, a.executed, a.reason)
    print(vigil.status("hello"))
    vigil.check()
    st = vigil.status("hello")
    serves(vigil, "hello", st["pid"], b)
