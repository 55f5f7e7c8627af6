"""SQL views operators read with the sqlite3 shell or psql. Created by migrations."""

from models.states import OPEN_RELOAD, OPEN_ROLLOUT, OPEN_STOP, OPEN_WAKE, OWED_RUN, WakeState


def _in(values: tuple) -> str:  # type: ignore[type-arg]
    return ", ".join(f"'{v.value}'" for v in values)


_WAKE_RUNNING = tuple(s for s in OPEN_WAKE if s is not WakeState.unproven)

# A rollout belongs to no host: its row shows as `rollout #<id>` in the host column (no
# host name can hold a space or '#'), and the reconciler paces it under that name.
ROLLOUT_LABEL_SQL = "'rollout #' || CAST(id AS VARCHAR(20))"
# Likewise a delivery shows (and is paced) as `notify <notifier>`: one try per notifier in
# flight, so a receiver that hangs holds one slot, not the round.
NOTIFY_LABEL_SQL = "'notify ' || notifier"

# Columns: kind, host, generation, since, attempts, next_attempt_at, last_error.
PENDING_OBLIGATIONS = f"""
CREATE VIEW pending_obligations AS
SELECT 'wake' AS kind, host, generation_id AS generation, since, attempts,
       next_attempt_at, last_error FROM wakes WHERE state IN ({_in(_WAKE_RUNNING)})
UNION ALL
SELECT 'unproven_wake', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM wakes WHERE state = 'unproven'
UNION ALL
SELECT 'stop', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM stops WHERE state IN ({_in(OPEN_STOP)})
UNION ALL
SELECT 'release', host, CAST(NULL AS INTEGER), since, attempts, next_attempt_at, last_error
  FROM releases
UNION ALL
SELECT 'restore', host, CAST(NULL AS INTEGER), since, attempts, next_attempt_at, last_error
  FROM restores
UNION ALL
SELECT 'attempt', host, successor_id, since, attempts, next_attempt_at, last_error
  FROM attempts WHERE outcome IS NULL
UNION ALL
SELECT CASE WHEN unproven THEN 'unproven_member' ELSE 'member' END, host, generation_id,
       since, attempts, next_attempt_at, last_error
  FROM members
UNION ALL
SELECT 'rollout', {ROLLOUT_LABEL_SQL}, CAST(NULL AS INTEGER), since, attempts, next_attempt_at,
       last_error
  FROM rollouts WHERE state IN ({_in(OPEN_ROLLOUT)})
UNION ALL
SELECT 'notification', {NOTIFY_LABEL_SQL}, generation_id, since, attempts, next_attempt_at,
       last_error
  FROM deliveries WHERE delivered_at IS NULL
UNION ALL
SELECT 'reload', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM reloads WHERE state IN ({_in(OPEN_RELOAD)})
UNION ALL
SELECT 'job_run', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM job_runs WHERE state IN ({_in(OWED_RUN)})
"""
