"""The script that `forkrun`'s torchrun runs (`--run-path`) in each forked rank: the worker, with its arguments."""
import sys

from unbroken.runtime.launcher.forkrun import run_worker

run_worker(sys.argv[1:])
