"""What a host's probes ask of its app (issue 39 item 4), for readiness (`hosts.ready`) and
for the ongoing health probe (`hosts.health`, migration 0036):

- http (stored as NULL or "http"): `GET /` on the generation's own `$VIGIL_SOCKET`
  answers below 500, as ever;
- http:PATH: `GET PATH` there answers 2xx or 3xx (a path of the app's own is asked for a
  real answer: a 404 of a router that lacks the path is no health);
- tcp: a connect to the generation's own `$VIGIL_SOCKET` is accepted (the app listens).
  Never a connect through a shared listener: vigil holds it, so the kernel accepts one
  whether the app is up or not (DESIGN.md section 9);
- exec:CMD: `/bin/sh -c CMD` exits 0, as the app's user, bounded in time (readiness:
  tried again until the health timeout; the health probe: once, within the health
  timeout and at most the interval), its process group killed when over time;
- notify (readiness only): READY=1 on its own `$NOTIFY_SOCKET`.

Parsed here, so the CLI, the hosts file and the workflows read one grammar."""

from __future__ import annotations

from dataclasses import dataclass

from models.errors import BadInput

HTTP, TCP, NOTIFY, EXEC = "http", "tcp", "notify", "exec"
READY_KINDS = (HTTP, TCP, EXEC, NOTIFY)
HEALTH_KINDS = (HTTP, TCP, EXEC)
OWN_SOCKET = (HTTP, TCP)  # the kinds probed on the generation's own $VIGIL_SOCKET
MAX_PATH = 1024


@dataclass(frozen=True)
class Probe:
    kind: str  # one of READY_KINDS
    path: str | None = None  # http: None is `GET /` below 500; a path asks 2xx/3xx
    command: str = ""  # exec


def probe_of(text: str | None) -> Probe:
    """The stored value read back (already checked by parse_probe)."""
    if text is None or text == HTTP:
        return Probe(HTTP)
    kind, _, rest = text.partition(":")
    if kind == HTTP:
        return Probe(HTTP, path=rest)
    if kind == EXEC:
        return Probe(EXEC, command=rest)
    return Probe(kind)


def _examples(kinds: tuple[str, ...], option: str) -> str:
    shown = {HTTP: f"{option}http:/healthz (GET PATH on $VIGIL_SOCKET answers 2xx/3xx)",
             TCP: f"{option}tcp (a connect to $VIGIL_SOCKET is accepted)",
             EXEC: f"{option}'exec:curl -fs http://127.0.0.1:8080/' (exits 0)",
             NOTIFY: f"{option}notify (READY=1 on $NOTIFY_SOCKET)"}
    return "write " + ", ".join(shown[k] for k in kinds)


def parse_probe(text: str, label: str, kinds: tuple[str, ...]) -> str:
    """`text` checked and as it is stored; raises BadInput naming `label` (`--ready `)."""
    option = label if label.startswith("--") else ""
    words = [w for k in kinds for w in ((HTTP, "http:PATH") if k == HTTP else
                                         ("exec:CMD",) if k == EXEC else (k,))]
    names = ", ".join(words[:-1]) + " or " + words[-1]
    kind, sep, rest = text.partition(":")
    if text == HTTP or (text in kinds and kind != EXEC):
        return text
    if kind == HTTP and sep:
        if not rest.startswith("/") or len(rest) > MAX_PATH or not all(
                33 <= ord(c) < 127 for c in rest):
            raise BadInput(f"{label}{text!r}: the path of http:PATH must start with / and hold "
                           "no space or control character", f"write e.g. {option}http:/healthz")
        return text
    if kind == EXEC and sep and EXEC in kinds:
        if not rest.strip() or "\0" in rest:
            raise BadInput(f"{label}{text!r}: exec: names no command",
                           f"write e.g. {option}'exec:curl -fs http://127.0.0.1:8080/'")
        return text
    raise BadInput(f"{label}{text!r}: not {names}", _examples(kinds, option))
