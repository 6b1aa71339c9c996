"""torchrun whose workers fork from its agent: `python -m unbroken.runtime.trainer.forkrun TORCHRUN_FLAGS
-m unbroken.runtime.trainer [ARGS]`, the same flags and the same agent as `torchrun`.

Owns: that command, and the forked worker's two ends of torchrun's function-entrypoint protocol (its
signal handlers reset, its return value handed to the agent before the process exits). Does not own: the
elastic agent (torch's `torch.distributed.run`, run unchanged: rendezvous, restarts, SIGTERM to a failed
group), what a worker does (the worker), or when a group starts (launch.py, starting.py).

Why: under `torchrun ... -m unbroken.runtime.trainer` each rank is a fresh interpreter that spends ~3 CPU-s
importing torch, DTensor and torch._dynamo (AdamW's first step) before its first microbatch, at every
start and every restart of its group. This command imports them once in the agent and runs torchrun with
its own `--run-path --start-method=fork`: each rank is the agent's forked child, an ordinary process with
its own pid, environment (torchrun's RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, ...), real signals and
exit codes, started in milliseconds. The local launcher uses it for groups of several ranks (`--launch.launcher
=fork`, the default); on a cluster it is a drop-in for the torchrun line that makes a restarted group's
ranks ready ~3 s sooner. `--launch.launcher=torchrun` runs the plain command.

Forking after `import torch` is safe where the agent has run no tensor op (no intra-op pool to inherit):
it has not. Its rendezvous store's threads are not copied into a child, and a child touches none of the
agent's objects: it ends by `os._exit`, so no inherited destructor runs.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path

WORKERS = ("unbroken.runtime.trainer", "unbroken.runtime.trainer.lifecycle")  # `-m` names of the trainer
ENTRY = Path(__file__).with_name("_forked_entry.py")  # the script torchrun's --run-path runs in each child

# torch's function-entrypoint wrapper (torch.distributed.elastic.multiprocessing.api._wrap) and the locals
# through which it hands a worker's return value to the agent: a worker that exits without putting one
# there leaves the agent waiting for it forever, so `_hand_back` does what `_wrap` does after its function
# returns, from the worker's exit (which must skip destructors: `os._exit`)
_WRAP_LOCALS = ("ret_val_", "queue_finished_reading_event")


def forkable() -> bool:
    """Whether this torch's agent can fork our workers: its wrapper has the locals `_hand_back` uses."""
    try:
        from torch.distributed.elastic.multiprocessing import api
    except ImportError:
        return False
    code = getattr(getattr(api, "_wrap", None), "__code__", None)
    return code is not None and all(v in code.co_varnames for v in _WRAP_LOCALS)


def main(argv: list[str] | None = None) -> None:
    """The command: torchrun's flags, parsed by torchrun. A worker other than ours (a user's script), or a
    torch whose wrapper differs, runs as plain torchrun would run it (fresh interpreters)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    os.environ.pop("UNBROKEN_FORKED", None)  # the agent's: its ranks say whether they were forked
    args = torchrun.parse_args(argv)
    if args.module and args.training_script in WORKERS and not args.no_python and forkable():
        import torch._dynamo  # noqa: F401 - what AdamW's first step imports (~0.8 CPU-s), done once here

        import unbroken.runtime.trainer.lifecycle  # noqa: F401 - torch, DTensor, DCP, gloo: what every rank imports

        gc.collect()
        gc.freeze()  # kept out of the ranks' collections: else each would copy every inherited page

        args.module, args.run_path, args.start_method = False, True, "fork"
        args.training_script = str(ENTRY)
    record(torchrun.run)(args)


def run_worker(argv: list[str]) -> None:
    """In a forked rank (the entry script): become the worker; never returns. The agent's Python signal
    handlers came with the fork (torchrun's turn SIGTERM into an exception); a rank starts with the ones a
    fresh interpreter has, so torchrun's SIGTERM ends it as it ends an exec'd rank."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [WORKERS[0], *argv]
    os.environ["UNBROKEN_FORKED"] = "agent"  # worker_start's `forked`
    import torch.multiprocessing

    torch.multiprocessing._set_thread_name("ub:rank")  # for `ps -o comm`: its command line is the agent's
    from unbroken.runtime.trainer import lifecycle as worker

    worker.main(argv, exit=_exit)


def _exit(code: int) -> None:
    """The worker's exit in a forked rank: a clean end hands its return value to the agent first (else
    the agent never sees the group succeed), then the process ends without running destructors."""
    if code == 0:
        _hand_back()
    os._exit(code)


def _hand_back() -> None:
    """What torch's `_wrap` does after its function returns: put the return value (None) on this rank's
    queue, then wait until the agent has read every rank's (it then lets them exit)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and all(v in frame.f_locals for v in _WRAP_LOCALS):
            frame.f_locals["ret_val_"].put(None)
            frame.f_locals["queue_finished_reading_event"].wait()
            return
        frame = frame.f_back


if __name__ == "__main__":
    main()
