"""Sending a notification: a shell command given the event on its stdin, killed (its whole
session, by pid) past its timeout; or a POST of the event to a webhook with the standard
library's urllib, bounded by the same timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request

from models.states import TryOutcome
from workflows.base.ports import Sent

TAIL = 300  # bytes of a failed command's stderr, or of a refusing webhook's answer, kept


def _tail(data: bytes) -> str:
    text = data[-TAIL:].decode("utf-8", "replace").strip()
    return " ".join(text.split())  # one line in the log


class Notices:
    def run(self, command: str, body: bytes, env: dict[str, str], timeout: float) -> Sent:
        with tempfile.TemporaryFile() as err:
            try:
                # Its own session: a timeout kills the command and everything it started.
                proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=err,
                                        env={**os.environ, **env}, start_new_session=True)
            except OSError as exc:
                return Sent(TryOutcome.failed, None, f"cannot run /bin/sh: {exc.strerror}")
            try:
                proc.communicate(body, timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # ended meanwhile
                proc.wait()
                return Sent(TryOutcome.timeout, None,
                            f"still running after {timeout:g}s: killed (pid {proc.pid})")
            code = proc.returncode
            if code == 0:
                return Sent(TryOutcome.delivered, 0)
            err.seek(0)
            said = _tail(err.read())
            how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
            return Sent(TryOutcome.failed, code, how + (f": {said}" if said else ""))

    def post(self, url: str, body: bytes, headers: dict[str, str], timeout: float) -> Sent:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                status = int(answer.status)
        except urllib.error.HTTPError as exc:
            said = _tail(exc.read() or b"")
            return Sent(TryOutcome.failed, exc.code,
                        f"HTTP {exc.code} {exc.reason}" + (f": {said}" if said else ""))
        except TimeoutError:
            return Sent(TryOutcome.timeout, None, f"no answer within {timeout:g}s")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                return Sent(TryOutcome.timeout, None, f"no answer within {timeout:g}s")
            return Sent(TryOutcome.failed, None, f"cannot POST to {url}: {reason}")
        if 200 <= status < 300:
            return Sent(TryOutcome.delivered, status)
        return Sent(TryOutcome.failed, status, f"HTTP {status}: not a 2xx answer")
