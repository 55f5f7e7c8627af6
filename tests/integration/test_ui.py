"""`vigil ui` (issue 23): the status page in a real browser, Debian's chromium headless
driven by playwright (pointed at /usr/bin/chromium: nothing downloaded). After a deploy and
after a failed rollout it shows what a person looks for, without a reload; the token is
refused when wrong; no env value reaches the page. Screenshots are kept under the test's tmp
dir and their paths printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import HELLO, ROOT, Vigil
from tests.integration.test_rollouts import build_variant

pytestmark = pytest.mark.timeout(300)
CHROMIUM = Path("/usr/bin/chromium")
SECRET = "hunter2-never-on-the-page"


def serve(v: Vigil, *args: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "ui", *args], env=v.env,
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if "vigil ui: serving" not in line:  # ended here: a failed test leaves no server behind
        ended(p)
        raise AssertionError(line)
    return p, line.split(" on ")[1].split()[0]


def ended(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait(10)
    if p.stdout is not None:
        p.stdout.close()


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def browser() -> Iterator[object]:
    playwright = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (Debian: apt-get install chromium)")
    with playwright.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield b
        b.close()


def test_the_page_after_a_deploy_and_a_failed_rollout(vigil: Vigil, short_tmp: Path,
                                                      tmp_path: Path, browser: object) -> None:
    flags = short_tmp / "flags"
    flags.mkdir()
    for h in ("web1", "web2"):
        vigil.run("host", "add", h, "--build", str(HELLO), "--health-timeout", "5",
                  "--drain-timeout", "3", "--env", f"APP_SECRET={SECRET}")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web*", "--wait", timeout=60)
    ui, url = serve(vigil, "--listen", "127.0.0.1:0")
    try:
        page = browser.new_page()  # type: ignore[attr-defined]
        page.goto(url)
        page.wait_for_selector("#hosts tbody tr >> nth=1")
        first = vigil.status("web1")["generation"]
        assert page.locator("#hosts tbody tr").nth(0).locator("td").nth(1).text_content() == "awake"

        vigil.run("deploy", "web1", str(build_variant(short_tmp / "next.py")), "--wait")
        now = vigil.status("web1")["generation"]
        page.wait_for_function(  # redrawn by the page itself: no reload
            "g => [...document.querySelectorAll('#hosts tbody tr')].some("
            "r => r.cells[0].textContent === 'web1' && r.cells[2].textContent === 'g' + g)",
            arg=now, timeout=15_000)
        timeline = page.locator("#timeline tbody").text_content()
        assert "switched" in timeline and "web1" in timeline and now != first
        shot = tmp_path / "ui-after-deploy.png"  # pytest keeps its tmp dirs
        page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot: {shot}")

        os.kill(vigil.status("web2")["pid"], signal.SIGKILL)  # a crash: the agent restarts it
        page.locator('#restarts svg[data-host="web2"] rect[height]:not([height="1"])').wait_for(
            timeout=30_000)

        (flags / "fail-web2").touch()
        bad = build_variant(short_tmp / "bad.py", flags, tag="bad")
        cp = vigil.run("rollout", "start", str(bad), "--hosts", "web*", "--waves", "1,100%",
                       "--wait", "--timeout", "120", check=False, timeout=150)
        assert cp.returncode == 1 and "halted: host web2 failed" in cp.stderr, cp.stderr
        halted = page.locator("#timeline tbody td.bad", has_text="rollout halted")
        halted.wait_for(timeout=15_000)
        # A rollout's rows name their hosts (the event names none): the rollout's, a wave's.
        requested = page.locator("#timeline tbody tr", has_text="rollout requested")
        assert requested.locator("td").nth(2).text_content() == "web1, web2"
        waves = page.locator("#timeline tbody tr", has_text="wave admitted")
        assert {waves.nth(i).locator("td").nth(2).text_content()
                for i in range(waves.count())} <= {"web1", "web2"} and waves.count() >= 1
        # The strip and the restart chart span the window (1280 px), labels readable.
        now = float(page.locator("#timeline-strip text", has_text="now").get_attribute("x"))
        bar = page.locator('#restarts svg[data-host="web2"] rect').first
        label = page.locator('#restarts svg[data-host="web2"] text').first
        assert now > 1100 and float(bar.get_attribute("width")) >= 20, now
        assert label.evaluate("t => getComputedStyle(t).fontSize") == "13px"
        shown = page.locator("body").inner_text()
        assert "wave admitted" in shown and "rollout requested" in shown
        shot = tmp_path / "ui-after-failed-rollout.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")
        assert SECRET not in page.content() and SECRET.encode() not in get(url + "api/state")[1]
    finally:
        ended(ui)


def test_off_loopback_the_token_is_required_and_a_wrong_one_refused(
        vigil: Vigil, short_tmp: Path, browser: object) -> None:
    vigil.add_host("hello")
    cp = vigil.run("ui", "--listen", "0.0.0.0:0", check=False)
    assert cp.returncode != 0 and "is not a loopback address" in cp.stderr
    assert "--token-file" in cp.stderr and len(cp.stderr.strip().splitlines()) <= 2, cp.stderr
    short = short_tmp / "short-token"
    short.write_text("abc\n")
    cp = vigil.run("ui", "--listen", "0.0.0.0:0", "--token-file", str(short), check=False)
    assert cp.returncode != 0 and "a token of 3 characters" in cp.stderr, cp.stderr
    token = "0123456789abcdef0123"
    (short_tmp / "token").write_text(token + "\n")
    (short_tmp / "token").chmod(0o600)  # one others can read is warned of (test_hostile_round3_web)
    ui, url = serve(vigil, "--listen", "0.0.0.0:0", "--token-file", str(short_tmp / "token"))
    try:
        api = url.replace("0.0.0.0", "127.0.0.1") + "api/state"
        assert get(api)[0] == 401 and get(api, "wrong" + token)[0] == 401
        status, body = get(api, token)
        assert status == 200 and json.loads(body)["hosts"][0][0] == "hello"
        page = browser.new_page()  # type: ignore[attr-defined]
        page.goto(api.removesuffix("api/state") + "?token=not-it")
        page.locator("#stale", has_text="the token was refused").wait_for(timeout=10_000)
        page.goto(api.removesuffix("api/state") + f"?token={token}")
        page.wait_for_selector("#hosts tbody tr")
        assert "token" not in page.url  # dropped from the address bar
    finally:
        ended(ui)


def test_ui_is_refused_on_a_bad_listen(vigil: Vigil) -> None:
    for bad, cause in (("127.0.0.1:99999", "is not HOST:PORT"), ("nowhere:80", "not an IP")):
        cp = vigil.run("ui", "--listen", bad, check=False)
        assert cp.returncode != 0 and cause in cp.stderr, cp.stderr
