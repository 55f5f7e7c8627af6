"""The fence file is written by several agent threads at once (lease renewal, the spawn
guard of each drive): a write must never fail or leave a torn file because another thread
renamed its temporary file away."""

from __future__ import annotations

import threading
from pathlib import Path

from runners.keepers.fencekeeper import read_fence, write_fence


def test_concurrent_fence_writes_never_fail(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def writer(n: int) -> None:
        start.wait()
        for i in range(300):
            try:
                write_fence(tmp_path, {"writer": n, "i": i, "generations": [{"uuid": "x" * 64}] * 20})
            except BaseException as exc:  # noqa: BLE001 (the test reports every failure)
                errors.append(exc)
                return

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    data = read_fence(tmp_path)
    assert data is not None and data["i"] == 299
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fence.json"]  # no temporary left
