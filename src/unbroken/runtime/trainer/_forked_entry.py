"""The script that `forkrun`'s torchrun runs (`--run-path`) in each forked rank: the worker, with its arguments."""
import sys

from unbroken.runtime.trainer.forkrun import run_worker

if __name__ == "__main__":  # torchrun's run_script_path runs it as __main__; an import does nothing
    run_worker(sys.argv[1:])
