"""Wave sizes: `--waves 1,25%,100%` parsed, and how many hosts each wave reaches."""

from __future__ import annotations

import math

from models.errors import BadInput

DEFAULT_WAVES = "1,25%,100%"
WAVES_FIX = "write cumulative wave sizes as host counts or percentages, e.g. --waves 1,25%,100%"


def parse_waves(spec: str) -> list[tuple[float, bool]]:
    """`1,25%,100%` -> [(1, False), (25, True), (100, True)]: cumulative sizes, each a host
    count (at least 1) or a percentage of the hosts (above 0, at most 100)."""
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise BadInput(f"--waves {spec!r} has an empty wave", WAVES_FIX)
    out: list[tuple[float, bool]] = []
    for p in parts:
        pct = p.endswith("%")
        text = p[:-1].strip() if pct else p
        try:
            value = float(text) if pct else int(text)
        except ValueError:
            raise BadInput(f"--waves {spec!r}: {p!r} is neither a host count nor a percentage",
                           WAVES_FIX) from None
        if pct and not (0 < value <= 100 and math.isfinite(value)):
            raise BadInput(f"--waves {spec!r}: {p!r} is not a percentage above 0 and at most 100",
                           WAVES_FIX)
        if not pct and value < 1:
            raise BadInput(f"--waves {spec!r}: {p!r} is not a host count of at least 1", WAVES_FIX)
        same = [v for v, was_pct in out if was_pct == pct]
        if same and value < same[-1]:
            raise BadInput(f"--waves {spec!r}: {p!r} is smaller than the wave before it: waves "
                           "are cumulative", WAVES_FIX)
        out.append((float(value), pct))
    return out


def wave_ends(spec: str, hosts: int) -> list[int]:
    """How many hosts have been reached once each wave is admitted: ascending, ending at
    `hosts` (the hosts past the last wave given form one more wave). A count and a
    percentage that come out smaller than the wave before (say 3,25% of 4 hosts) merge."""
    ends: list[int] = []
    for value, pct in parse_waves(spec):
        n = math.ceil(value * hosts / 100 - 1e-9) if pct else int(value)
        n = max(1, min(hosts, n))
        if not ends or n > ends[-1]:
            ends.append(n)
    if ends[-1] < hosts:
        ends.append(hosts)
    return ends
