"""`vigil apply`: make the hosts in the store match a file.

Each host is one transaction that compares the stored row with the wanted one and writes
the difference (with its event), so a plan and its application are the same code, and a
concurrent change is seen, never overwritten blindly:

- a host not in the store is added (asleep: `vigil wake` starts it);
- changed fields are written and take effect at the host's next start;
- a changed build of a host that runs (awake, waking or deploying) becomes a deploy
  attempt with cause `config`; of a host that does not run, it is set for its next wake;
- a host not in the file is removed, only once nothing of it runs: apply refuses (and
  changes nothing at all) while such a host is awake; stop it first, or keep it in the file;
- changing the kind of a host that runs is refused the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import Refused
from models.states import Cause, HostKind, Mode
from models.store import emit, utcnow
from models.tables import Build, Host, Lease
from models.transition import move
from workflows.base.lookups import open_attempt
from workflows.base.waivers import OPERATOR
from workflows.config.hostrows import host_state
from workflows.config.hosts import check_name, record_build, remove_host
from workflows.deploys.request import request_deploy
from workflows.generations.listeners import Listen, as_listens, check_free, stored, write_set
from workflows.leases.lease import still_needed
from workflows.lifecycle.order import check_graph

JSON_COLUMNS = ("args", "env", "start_after")  # stored as JSON text
LABELS = {"start_after": "after"}  # a column shown by its key in the hosts file
RUNS = ("awake", "unhealthy", "waking", "waiting", "crashloop", "deploying")  # a changed build becomes a deploy attempt


@dataclass(frozen=True)
class Wanted:
    name: str
    fields: dict[str, Any]  # host column -> value, every mapped column
    build_path: str  # the staged path (`vigil apply --dry-run`: where it would be staged)
    digest: str
    source: str
    listens: list[Listen] = field(default_factory=list)


@dataclass
class Change:
    action: str  # add | update | deploy | remove | keep
    host: str
    details: list[str] = field(default_factory=list)
    note: str = ""
    attempt: int | None = None

    def line(self) -> str:
        mark = {"add": "+", "remove": "-", "keep": "="}.get(self.action, "~")
        text = f"{mark} {self.action} {self.host}"
        if self.details:
            text += ": " + ", ".join(self.details)
        if self.attempt is not None:
            text += f" (attempt #{self.attempt})"
        return text + (f" ({self.note})" if self.note else "")


# A NULL that `host show` shows as the default it stands for: a dry run says the same.
NULL_SHOWN = {"ready": "http", "health": "http"}


def _show(column: str, value: Any) -> str:
    if value is None:
        return f"{json.dumps(NULL_SHOWN[column])} (default)" if column in NULL_SHOWN else "unset"
    if column == "env":
        return "{" + ", ".join(sorted(value)) + "}"  # names only: values may be secrets
    if column == "socket_mode":
        return f"0{value:o}"
    if isinstance(value, HostKind):
        return value.value
    return json.dumps(value)


def _stored(h: Host, column: str) -> Any:
    value = getattr(h, column)
    return json.loads(value) if column in JSON_COLUMNS else value


def _to_column(column: str, value: Any) -> Any:
    return json.dumps(value) if column in JSON_COLUMNS else value


def diff(s: Session, w: Wanted) -> Change:
    """What applying `w` would do now (reads only)."""
    h = s.get(Host, w.name)
    check_free(s, w.name, w.listens, h.box if h is not None else None)  # no placement in a file
    if h is None:
        return Change("add", w.name, [f"{w.fields['kind'].value}, build {w.digest[:12]}"]
                      + [f"listen {a.address}" for a in w.listens], "asleep until `vigil wake`")
    changed = [c for c, v in w.fields.items() if _stored(h, c) != v]
    details = [f"{LABELS.get(c, c)} {_show(c, _stored(h, c))} -> {_show(c, w.fields[c])}"
               for c in changed]
    have = as_listens(stored(s, w.name))
    if have != w.listens:
        changed.append("listen")
        details.append(f"listen {[a.address for a in have]} -> {[a.address for a in w.listens]}")
    build = s.get(Build, h.build_id)
    if not changed and build is not None and build.path == w.build_path:
        return Change("keep", w.name)  # its state is not read: nothing it gates changes
    state = host_state(s, w.name)
    if state not in RUNS and open_attempt(s, w.name) is not None:
        state = "deploying"  # a queued attempt would set its own build: supersede it
    for what in ("kind", "listen"):  # what every generation of it inherits
        if what in changed and state not in ("asleep", "down"):
            raise Refused(f"host {w.name} is {state}: its {what} cannot change while it runs",
                          f"stop it first with `vigil stop {w.name} --wait`, then apply again")
    if "instances" in changed and state not in ("asleep", "down"):
        raise Refused(f"host {w.name} is {state}: its instances change while it runs by "
                      f"`vigil scale {w.name} {w.fields['instances']}`",
                      f"run `vigil scale {w.name} {w.fields['instances']}`, then apply again")
    if build is None or build.path != w.build_path:
        old = build.digest[:12] if build else "?"
        details.append(f"build {old} -> {w.digest[:12]}")
        if state in RUNS:
            return Change("deploy", w.name, details, "a deploy attempt, cause config")
        return Change("update", w.name, details, "the build runs at its next wake")
    note = "takes effect at its next start" if state in RUNS else ""
    return Change("update", w.name, details, note)


def removal(s: Session, name: str) -> Change:
    """A host the file no longer names: removed only once nothing of it runs."""
    why = still_needed(s, name) or ("it holds its lease" if s.get(Lease, name) else None)
    if why is not None:
        raise Refused(f"host {name} is not in the file but cannot be removed: {why}",
                      f"stop it first with `vigil stop {name} --wait`, or keep it in the file")
    return Change("remove", name)


def plan(s: Session, wanted: list[Wanted]) -> list[Change]:
    """Every change, in file order, then the removals. Raises Refused when any is refused,
    so a refused plan changes nothing."""
    names = {w.name for w in wanted}
    check_graph({w.name: w.fields.get("start_after", []) for w in wanted})  # the file's own order
    changes = [diff(s, w) for w in wanted]
    stored = s.execute(select(Host.name).order_by(Host.name)).scalars().all()
    return changes + [removal(s, n) for n in stored if n not in names]


def apply_host(s: Session, w: Wanted) -> Change:
    """One host's change, in one transaction: recomputed here, so it acts on what is stored
    now; a row moved by someone else meanwhile fails the guarded update (LostRace)."""
    change = diff(s, w)
    if change.action == "keep":
        return change
    build = record_build(s, w.build_path, w.digest, w.source)
    h = s.get(Host, w.name)
    if h is None:
        check_name(w.name)
        s.add(Host(name=w.name, build_id=build.id, created_at=utcnow(),
                   **{c: _to_column(c, v) for c, v in w.fields.items()}))
        s.flush()
        write_set(s, w.name, w.listens, None)
        emit(s, "host_added", w.name, build=w.digest[:12], kind=w.fields["kind"].value,
             source="apply")
        return change
    if as_listens(stored(s, w.name)) != w.listens:
        write_set(s, w.name, w.listens, h.box)
        emit(s, "host_updated", w.name, fields=["listen"], source="apply")
    values = {c: _to_column(c, v) for c, v in w.fields.items() if _stored(h, c) != v}
    if change.action == "update" and h.build_id != build.id:
        values["build_id"] = build.id
    if values:
        move(s, Host, {"name": w.name, "build_id": h.build_id},
             values, f"host {w.name} update", fence=OPERATOR)
        emit(s, "host_updated", w.name, fields=sorted(values), source="apply")
    if change.action == "deploy":
        change.attempt = request_deploy(s, w.name, build, mode=Mode.overlap, canary=False,
                                        cause=Cause.config).id
    return change


def remove_absent(s: Session, name: str) -> Change:
    change = removal(s, name)
    remove_host(s, name)
    return change
