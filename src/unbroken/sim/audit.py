"""The audit: does a log commit exactly the steps and tokens its run_end claims?

Owns: replaying `step`, `steps` and `rollback` records of one run's log into the committed trajectory,
and checking it against the run_end record: steps 0..n-1 each committed exactly once in the final
trajectory, the tokens and the count of steps whose batch differed from M add up, and every GPU-hour of
the run is either useful or lost to a named cause. Does not own: producing logs (strategies/).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class AuditError(AssertionError):
    pass


@dataclass(frozen=True)
class Trajectory:
    batches: tuple[int, ...]  # microbatches reduced by each committed step, in step order
    tokens: int
    microbatches: int  # M of the run


def replay(records: list[dict[str, Any]]) -> Trajectory:
    """The final committed trajectory of a log. Raises AuditError on a gap, a repeat or a bad rollback."""
    start = next(r for r in records if r["event"] == "run_start")
    batches: list[int] = []
    tokens: list[int] = []
    for r in records:
        kind = r["event"]
        if kind == "step":
            runs = [(r["step"], 1, r["microbatches"], r["tokens"])]
        elif kind == "steps":
            runs = [(r["first"], r["count"], r["microbatches"], r["tokens"])]
        elif kind == "rollback":
            if r["from_step"] != len(batches) or not 0 <= r["to_step"] <= len(batches):
                raise AuditError(f"rollback {r['from_step']}->{r['to_step']} at {len(batches)} committed steps")
            if sum(tokens[r["to_step"]:]) != r["tokens"]:
                raise AuditError(f"rollback at t={r['t']} undoes {r['tokens']} tokens, log holds "
                                 f"{sum(tokens[r['to_step']:])}")
            del batches[r["to_step"]:], tokens[r["to_step"]:]
            continue
        else:
            continue
        for first, count, mbs, tok in runs:
            if first != len(batches):
                raise AuditError(f"{kind} record at t={r['t']} commits step {first}, expected {len(batches)}")
            if tok != count * mbs * start["tokens_per_microbatch"]:
                raise AuditError(f"{kind} record at t={r['t']}: {tok} tokens for {count} x {mbs} microbatches")
            batches.extend([mbs] * count)
            tokens.extend([tok // count] * count)
    return Trajectory(tuple(batches), sum(tokens), start["microbatches"])


def audit(records: list[dict[str, Any]]) -> Trajectory:
    """Check a simulated run's log against its run_end record; returns the trajectory. Raises AuditError."""
    traj = replay(records)
    end = next(r for r in records if r["event"] == "run_end")
    differ = sum(1 for b in traj.batches if b != traj.microbatches)
    checks = [
        (len(traj.batches) == end["steps_committed"], f"{len(traj.batches)} steps in the log, "
                                                     f"run_end claims {end['steps_committed']}"),
        (traj.tokens == end["tokens"], f"{traj.tokens} tokens in the log, run_end claims {end['tokens']}"),
        (differ == end["steps_batch_differs"], f"{differ} steps with a different batch in the log, "
                                               f"run_end claims {end['steps_batch_differs']}"),
    ]
    if "useful_gpu_hours" in end:
        total = end["useful_gpu_hours"] + sum(end["lost_gpu_hours"].values())
        checks.append((abs(total - end["gpu_hours"]) <= 1e-6 * max(1.0, end["gpu_hours"]) + 1e-4,
                       f"useful + lost = {total} GPU-h, the run had {end['gpu_hours']}"))
    for ok, msg in checks:
        if not ok:
            raise AuditError(msg)
    return traj
