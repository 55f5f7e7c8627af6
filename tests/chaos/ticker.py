#!/usr/bin/env python3
"""A child of every chaos generation: writes `tick N` (N = 0, 1, 2, ... with no gap) to
its stdout, the generation's log pipe, every 50 ms until killed. The chaos checker reads
the numbers back from the generation's log file: a gap is a lost line."""

import os
import signal
import sys
import time

os.closerange(3, 256)  # the listening sockets stay the leader's (LISTEN_FDS is for it)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # no reader left: die as a real app would
i = 0
while True:
    sys.stdout.write(f"tick {i}\n")
    sys.stdout.flush()
    i += 1
    time.sleep(0.05)
