#!/usr/bin/env python3
"""Fixture: an instance that starts serving (as hello) only once the file $GATE exists."""

import os
import sys
import time

while not os.path.exists(os.environ["GATE"]):
    time.sleep(0.05)
os.execv(sys.executable, [sys.executable, os.environ["THEN"]])
