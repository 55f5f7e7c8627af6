"""DBOS's side of bench/obligations.py, run by bench/.peers/bin/python (DBOS is installed
there, never in vigil's venv): one workflow of N trivial steps on a SQLite system database
in DIR, each step checkpointed by DBOS. Prints `steps_per_s=<x> journal=<mode> sync=<n>`."""

from __future__ import annotations

import sqlite3
import sys
import time

from dbos import DBOS, DBOSConfig


def main() -> None:
    n, where = int(sys.argv[1]), sys.argv[2]
    db = f"{where}/dbos_sys.sqlite"
    config: DBOSConfig = {"name": "vigil-bench", "system_database_url": f"sqlite:///{db}",
                          "run_admin_server": False}
    DBOS(config=config)

    @DBOS.step()
    def step(i: int) -> int:
        return i

    @DBOS.workflow()
    def flow(count: int) -> int:
        return sum(step(i) for i in range(count))

    DBOS.launch()
    flow(10)  # warm up: tables, caches, the first workflow row
    t0 = time.perf_counter()
    flow(n)
    dt = time.perf_counter() - t0
    con = sqlite3.connect(db)
    journal = con.execute("PRAGMA journal_mode").fetchone()[0]
    con.close()
    DBOS.destroy()
    # DBOS leaves synchronous at SQLite's default (FULL, 2) and sets no journal mode itself.
    print(f"steps_per_s={n / dt:.1f} journal={journal}")


if __name__ == "__main__":
    main()
