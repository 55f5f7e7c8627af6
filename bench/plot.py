"""Pictures of bench/ runs for the docs: successful requests over time through deploys
(bench/downtime.py --plot), one panel per supervisor, every event of the run overlaid,
failed requests as red ticks on the axis. matplotlib is in the bench extra
(`pip install -e '.[bench]'`); it is imported only when a picture is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BIN = 0.05  # seconds per bar: requests/s over 50 ms


def rate(times: list[float], lo: float, hi: float) -> tuple[list[float], list[float]]:
    """Successes per second in BIN-wide bins from lo to hi: (bin starts, rates)."""
    n = max(1, int((hi - lo) / BIN) + 1)
    counts = [0] * n
    for t in times:
        i = int((t - lo) / BIN)
        if 0 <= i < n:
            counts[i] += 1
    return [lo + i * BIN for i in range(n)], [c / BIN for c in counts]


def downtime_svg(results: dict[str, list[Any]], out: Path, title: str, lead: float,
                 tail: float) -> None:
    """One panel a supervisor: each event's successful requests/s against the seconds from
    its deploy command (0 on the dotted line), its failures as red ticks at the bottom."""
    import matplotlib

    matplotlib.use("Agg")  # no screen: draw to a file
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable
    import matplotlib.pyplot as plt

    whos = list(results)
    fig, axes = plt.subplots(len(whos), 1, sharex=True, squeeze=False,
                             figsize=(9, 1.3 * len(whos) + 1.2))
    for ax, who in zip(axes[:, 0], whos, strict=True):
        evs = results[who]
        for ev in evs:
            x, y = rate(ev.oks, -lead, ev.wall + tail)
            ax.step(x, y, where="post", linewidth=0.8, alpha=0.7)
            if ev.fails:  # one tick a bin that had failures: thousands of them draw as one
                ticks = sorted({round(t / BIN) * BIN for t in ev.fails})
                ax.plot(ticks, [0] * len(ticks), "|", color="red", markersize=8)
        failed = sum(ev.failed for ev in evs)
        ax.axvline(0, color="gray", linestyle=":", linewidth=0.8)
        ax.set_ylabel(who, rotation=0, ha="right", va="center", fontsize=9)
        ax.text(0.995, 0.9, f"{failed} failed in {len(evs)} event(s)", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="red" if failed else "green")
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("seconds from the deploy command (successful requests/s, 50 ms bins)")
    fig.suptitle(f"One closed-loop client through deploys: {title}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg")
    plt.close(fig)
