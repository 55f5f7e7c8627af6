#!/usr/bin/env python3
"""`vigil ui`'s own cost at N hosts, beside supervisord's web page over N programs, in the
same run (interleaved), each watched by the same headless chromium (Debian's, driven by
playwright) at the same rate:

  vigil ui         `vigil ui` as a process, the page open in the browser: the page asks
                   /api/state every 2 s by itself (every host's row, the open obligations,
                   the hour's timeline and restart chart). Its server's CPU over a window
                   after the first rows are drawn, as % of one core; and one /api/state
                   answer's time and size, asked directly
  supervisord      supervisord 4.3 (bench/.peers) with N `sleep` programs and its
                   [inet_http_server] status page, which does not refresh itself: the
                   browser reloads it every 2 s, as an operator watching it would. Its
                   process's CPU over the same window (its programs stay idle)

The vigil store is seeded straight into SQLite as bench/top.py seeds it (no agent runs:
nothing acts on the rows; every generation's leader is one live `sleep`). With --shots DIR
the page's screenshot (PNG) and `vigil top`'s screen in an 80x24 tmux (text, capture-pane)
are kept there. Median (min-max) over the runs; every process started is ended by pid."""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEERS, ROOT, end, loadavg, no_store, ratios, summary, vigil_durability  # noqa: E402
from top import seed  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
EVERY = 2.0  # the page's own polling period (runners/cli/ui.js), matched for supervisord


def serve_ui(home: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "ui", "--listen", "127.0.0.1:0"],
                         env={"VIGIL_HOME": str(home), "PATH": "/usr/bin:/bin"}, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if "vigil ui: serving" not in line:
        end(p)  # type: ignore[arg-type]
        raise RuntimeError(f"vigil ui did not start: {line!r}")
    return p, line.split(" on ")[1].split()[0]


def supervisord(tmp: Path, n: int, port: int) -> subprocess.Popen[bytes]:
    """supervisord with N idle `sleep` programs and its web page on 127.0.0.1:port, returned
    once all N run."""
    d = tmp / "sup"
    d.mkdir()
    conf = d / "supervisord.conf"
    conf.write_text(f"""
[inet_http_server]
port=127.0.0.1:{port}
[supervisord]
logfile={d}/supervisord.log
pidfile={d}/supervisord.pid
childlogdir={d}
nodaemon=true
minfds={max(1024, 4 * n + 64)}
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[program:w]
command=sleep 3600
numprocs={n}
process_name=w%(process_num)05d
startsecs=0
""")
    proc = subprocess.Popen([str(PEERS / "bin" / "supervisord"), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ps, deadline = psutil.Process(proc.pid), time.monotonic() + 300
    while sum(c.status() != psutil.STATUS_ZOMBIE for c in ps.children()) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            end(proc, timeout=120)
            raise RuntimeError(f"supervisord did not start {n} programs (see {d}/supervisord.log)")
        time.sleep(0.2)
    return proc


def watched_cpu(page: Any, pid: int, window: float, reload: bool) -> float:
    """The server `pid`'s CPU while the browser keeps `page` live for `window` seconds, as %
    of one core; `reload`: the page does not refresh itself, reload it every EVERY s."""
    proc = psutil.Process(pid)
    t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
    nxt = t0 + EVERY
    while (now := time.monotonic()) - t0 < window:
        if reload and now >= nxt:
            page.reload(wait_until="load")
            nxt += EVERY
        page.wait_for_timeout(100)  # the browser's own loop runs meanwhile
    return 100 * (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)


def state_answer(url: str, asks: int) -> tuple[float, int]:
    """The median time of one /api/state answer (s) and its size (bytes)."""
    took, size = [], 0
    for _ in range(asks):
        t0 = time.monotonic()
        with urllib.request.urlopen(url + "api/state", timeout=60) as r:
            size = len(r.read())
        took.append(time.monotonic() - t0)
    return statistics.median(took), size


def top_screen(home: Path, out: Path) -> None:
    """`vigil top` in a detached 80x24 tmux session, its screen once drawn written to `out`."""
    name = f"vgtop{int(time.time() * 1000) % 10**8}"
    cmd = f"cd {ROOT} && VIGIL_HOME={home} {sys.executable} -m runners.cli top"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24", cmd],
                   check=True)
    try:
        deadline, screen = time.monotonic() + 60, ""
        while "agent:" not in screen:
            if time.monotonic() > deadline:
                raise RuntimeError(f"vigil top drew no screen in tmux: {screen!r}")
            time.sleep(0.2)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name],
                                    capture_output=True, text=True).stdout
        out.write_text(screen)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def one_run(args: argparse.Namespace, browser: Any, home: Path, sup_url: str, sup_pid: int,
            rows: dict[str, list[float]], shots: Path | None) -> None:
    ui, url = serve_ui(home)
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)
        page.wait_for_selector("#hosts tbody tr >> nth=1", timeout=120_000)
        rows["ui"].append(watched_cpu(page, ui.pid, args.window, reload=False))
        if shots is not None:
            page.screenshot(path=str(shots / f"ui-{args.hosts}-hosts.png"), full_page=False)
        page.close()
        ms, size = state_answer(url, 3)
        rows["state_ms"].append(ms)
        rows["state_kb"].append(size / 1024)
    finally:
        end(ui)  # type: ignore[arg-type]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(sup_url, wait_until="load")
    rows["sup"].append(watched_cpu(page, sup_pid, args.window, reload=True))
    page.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--window", type=float, default=20.0, help="seconds each page is watched per run")
    ap.add_argument("--port", type=int, default=19377, help="supervisord's web page's port")
    ap.add_argument("--shots", type=Path, default=None, help="keep the page's PNG and top's screen here")
    ap.add_argument("--quick", action="store_true", help="50 hosts, 1 run, 5 s windows")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.runs, args.window = 50, 1, 5.0
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sys.exit("bench/ui.py needs playwright (the test extra: ./scripts/install test)")
    if not CHROMIUM.exists() or not (PEERS / "bin" / "supervisord").exists():
        sys.exit("bench/ui.py needs /usr/bin/chromium (apt-get install chromium) and "
                 "supervisord (bench/install-peers --quick)")
    if args.shots is not None:
        args.shots.mkdir(parents=True, exist_ok=True)
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgui", dir="/tmp"))
    home = tmp / "state"
    sleeper = subprocess.Popen(["sleep", "3600"])
    sup = None
    rows: dict[str, list[float]] = {k: [] for k in ("ui", "sup", "state_ms", "state_kb")}
    try:
        seed(home, args.hosts, psutil.Process(sleeper.pid))
        if args.shots is not None:
            top_screen(home, args.shots / f"top-{args.hosts}-hosts.txt")
        sup = supervisord(tmp, args.hosts, args.port)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            try:
                for i in range(args.runs):
                    one_run(args, browser, home, f"http://127.0.0.1:{args.port}/", sup.pid,
                            rows, args.shots if i == 0 else None)
                    print(f"run {i + 1}: vigil ui {rows['ui'][-1]:.1f}% of a core, supervisord's "
                          f"page {rows['sup'][-1]:.1f}%, /api/state {rows['state_ms'][-1] * 1000:.0f} ms "
                          f"({rows['state_kb'][-1]:.0f} KiB)", flush=True)
            finally:
                browser.close()
        modes = vigil_durability(home / "vigil.db")
    finally:
        end(sup, timeout=120)
        end(sleeper)
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, rows, load0, modes)


def report(args: argparse.Namespace, rows: dict[str, list[float]], load0: str, modes: str) -> None:
    def pct(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f}% ({min(xs):.1f}-{max(xs):.1f})"

    print(f"\nhosts: {args.hosts}; runs: {args.runs} (interleaved), {args.window:g} s watched each; "
          f"loadavg start {load0}, end {loadavg()}")
    print(f"vigil ui, page open (% of a core)      : {pct(rows['ui'])}")
    print(f"supervisord, page reloaded every {EVERY:g} s : {pct(rows['sup'])}")
    print(f"ratio vigil ui / supervisord           : {summary(ratios(rows['ui'], rows['sup']), 'x')}")
    print(f"one /api/state answer                  : {summary(rows['state_ms'])}, "
          f"{statistics.median(rows['state_kb']):.0f} KiB")
    if args.shots is not None:
        print(f"screens kept: {args.shots / f'ui-{args.hosts}-hosts.png'}, "
              f"{args.shots / f'top-{args.hosts}-hosts.txt'}")
    print("result: ui " + " ".join([
        f"hosts={args.hosts}", f"vigil.ui_pct={statistics.median(rows['ui']):.1f}",
        f"supervisord.page_pct={statistics.median(rows['sup']):.1f}",
        f"vigil.state_ms={statistics.median(rows['state_ms']) * 1000:.0f}", modes,
        no_store("supervisord")]))


if __name__ == "__main__":
    main()
