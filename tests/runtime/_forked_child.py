"""A stand-in trainer for test_zygote.py: `main(argv)` prints what it was given, then exits with argv[0]
as its code, or, given "wait", sleeps until it is killed."""
from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> None:
    print(f"pid={os.getpid()} argv={argv} env={os.environ.get('FORKED_TEST', '')} stdin={sys.stdin.read()!r}",
          flush=True)
    if argv[0] == "wait":
        time.sleep(60)
    raise SystemExit(int(argv[0]))
