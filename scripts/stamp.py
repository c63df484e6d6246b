"""Prefix each line of standard input with the seconds since this script started (where a run's
time goes, line by line): ``cmd 2>&1 | python3 -u scripts/stamp.py > log``."""

import sys
import time

t0 = time.monotonic()
for line in sys.stdin:
    sys.stdout.write(f"{time.monotonic() - t0:7.2f} {line}")
    sys.stdout.flush()
