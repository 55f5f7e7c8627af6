"""DBOS's side of bench/obligations.py, run by bench/.peers/bin/python (DBOS is installed
there, never in vigil's venv): one workflow of N trivial steps on a SQLite system database
in DIR, each step checkpointed by DBOS. JOURNAL `default` leaves the file as DBOS makes it
(SQLite's rollback journal: DBOS sets no journal mode); `wal` creates the file in WAL mode
first (SQLite keeps WAL in the file, so DBOS's own connections run WAL). Prints
`steps_per_s=<x> journal=<mode> synchronous=<level>`, both read on DBOS's own connection."""

from __future__ import annotations

import sqlite3
import sys
import time

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig

SYNC_NAMES = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


def main() -> None:
    n, where = int(sys.argv[1]), sys.argv[2]
    journal = sys.argv[3] if len(sys.argv) > 3 else "default"
    db = f"{where}/dbos_sys.sqlite"
    if journal == "wal":
        con = sqlite3.connect(db)
        con.execute("PRAGMA journal_mode=WAL")
        con.close()
    config: DBOSConfig = {"name": "vigil-bench", "system_database_url": f"sqlite:///{db}",
                          "run_admin_server": False}
    dbos = DBOS(config=config)

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
    with dbos._sys_db.engine.connect() as c:  # one of DBOS's own connections, its pragmas set
        mode = c.execute(sa.text("PRAGMA journal_mode")).scalar()
        sync = c.execute(sa.text("PRAGMA synchronous")).scalar()
    DBOS.destroy()
    print(f"steps_per_s={n / dt:.1f} journal={str(mode).lower()} synchronous={SYNC_NAMES.get(sync, sync)}")


if __name__ == "__main__":
    main()
