"""The coordinator process: hosts the TCPStore, keeps membership epochs, watches heartbeats, fences.

Owns: the store server (so a trainer's death never takes the store with it), the membership epoch and its
member lists, dead verdicts (heartbeat silence, no progress, or an exit the launcher reported), and the
`failed` record when every replica is gone. Does not own: step decisions (members compare-and-set them),
or starting processes (launch.py). What operators watch (/metrics, TensorBoard, `unbroken status`) it
serves through runtime/coordinator/metrics.py, which reads the event log, never the coordinator's own state.

Run as `python -m unbroken.runtime.coordinator.coordinator --replicas R --run-dir DIR [...]`; it prints
`UNBROKEN_STORE=host:port` on its first stdout line, then serves until the key `shutdown` appears
(the launcher wakes its loop after writing it, as after an exit: watch.wake).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

from collections.abc import Callable

from torch.distributed import PrefixStore, Store, TCPStore

from unbroken.config import DetectorSection
from unbroken.events import EventLog
from unbroken.policy.membership import REFORMS_BEFORE_LEAVING, Beat, Membership, excuse, stale
from unbroken.runtime.store import keys
from unbroken.runtime.store.watch import WakeWatch
from unbroken.runtime.coordinator.metrics import Exporter
from unbroken.runtime.store.client import connect, finished_among, last_committed, read
from unbroken.runtime.coordinator.replan import QUOTAS, GroupShape, parse_shape, planner_for
from unbroken.runtime.coordinator.slowness import SlownessMonitor

FENCED = "fenced"  # what stands in hb/{r} once r was declared dead (after dead/{r})


class Coordinator:
    def __init__(self, store: TCPStore, replicas: int, log: EventLog, heartbeat_timeout: float,
                 progress_timeout: float, startup_timeout: float, quotas: str = "speed",
                 beat_every: float = 0.1, group_size: int = 1, shape: GroupShape | None = None,
                 detector: DetectorSection | None = None):
        self.store, self.log = store, log
        self.ranks = range(group_size)  # every rank of a member group beats; one silent rank kills the group
        # shape (the groups' plan and model): a group turning Slow or Healthy is re-planned (replan.py);
        # detector: config [detector], the fail-slow detector's thresholds (None: its defaults)
        self.slowness = SlownessMonitor(store, log, quotas, planner_for(shape, replicas, log, quotas), detector)
        self.hb_timeout, self.progress_timeout = heartbeat_timeout, progress_timeout
        self.startup_timeout = startup_timeout
        self.membership = Membership.initial(replicas)
        self.replicas = replicas
        self.beats: dict[tuple[int, int], Beat] = {}  # (member, rank) -> its last beat
        self.exits_seen = 0
        self._reforms: tuple[object, int] = (None, 0)  # ((members, last committed step), re-forms in a row)
        self.next_beats = 0.0  # monotonic time of the next round that reads heartbeats
        # (nfinished, members that applied their last step): no longer judged
        self.finished: tuple[int, frozenset[int]] = (0, frozenset())
        self.beat_every = beat_every
        if store.check([keys.epoch()]):  # a standby that took over (etcd): the membership is the store's;
            epoch = int(store.get(keys.epoch()))  # beats, exits and finished members are re-read each round
            self.membership = Membership(epoch, tuple(json.loads(store.get(keys.members(epoch)))))
            self.slowness.catch_up()
            return
        store.set(keys.weights(), "{}")  # equal quotas until the detector says otherwise
        store.set(keys.members(0), json.dumps(list(self.membership.members)))
        store.set(keys.epoch(), "0")
        log.emit("epoch", epoch=0, members=list(self.membership.members))

    def poll(self, now: float, exits: bool = True) -> bool:
        """One round: read exits (if `exits` or on a beat round) and beats (every `beat_every` s), declare
        the dead, publish a new epoch. Returns False once every member is gone.

        Call every `beat_every` s and whenever the launcher wakes the loop (`exits`: the fast path to
        a verdict, a kill costs no heartbeat timeout). A beat round (heartbeats, exits, finished members,
        re-form requests, the detector's new steps) is about five store round trips."""
        verdicts: dict[int, str] = {}
        if self.next_beats and now - self.next_beats > self.hb_timeout / 2:  # we could not look: nobody's fault
            self.beats = excuse(self.beats, now - self.next_beats)
        beats = now >= self.next_beats
        if beats:
            self.next_beats = now + self.beat_every
            self.finished = finished_among(self.store, self.membership.members, self.finished)
        members = tuple(m for m in self.membership.members if m not in self.finished[1])
        if not members:  # every remaining member finished its last step: read the steps not read yet
            if beats:
                self.drain()
            return True
        if beats:
            ranks = [(m, j) for m in members for j in self.ranks]
            self._read_beats(ranks, now)
            for (m, j), why in stale(self.beats, ranks, now, self.hb_timeout, self.progress_timeout,
                                     self.startup_timeout).items():
                verdicts.setdefault(m, why if len(self.ranks) == 1 else f"rank {j}: {why}")
        nexits = self.store.add(keys.exits(), 0) if exits or beats else self.exits_seen
        if nexits != self.exits_seen:
            self.exits_seen = nexits
            for m in members:
                if self.store.check([keys.exited(m)]):
                    said = self.store.get(keys.exited(m)).decode()
                    verdicts.setdefault(m, f"process exited with code {said}" if said.lstrip("-").isdigit() else said)
        if verdicts:
            self._remove(verdicts)
        elif beats:
            self._reform()
            self._admit()
        if beats:  # the detector needs committed steps' timings, not within 20 ms of the commit
            self.slowness.poll(self.membership.epoch)
            evicted = {g: why for g, why in self.slowness.evictions().items() if g in self.membership.members}
            if evicted:  # a slow rank the scheduler shrinks its group around: lost, as a dead rank is
                self._remove(evicted)
        return bool(self.membership.members)

    def _read_beats(self, ranks: list[tuple[int, int]], now: float) -> None:
        # (member, rank)s that beat before: one multi_get; the rest (start-up) one check each.
        known = [m for m in ranks if m in self.beats]
        fresh = [m for m in ranks if m not in self.beats and self.store.check([keys.heartbeat(*m)])]
        values = self.store.multi_get([keys.heartbeat(*m) for m in known + fresh]) if known or fresh else []
        for m, value in zip(known + fresh, values):
            hb = json.loads(value)
            old = self.beats.get(m)
            where = (hb["step"], hb["phase"], hb["mb"])
            if old is None or old.seq != hb["seq"]:
                moved = old is None or (old.step, old.phase, old.microbatch) != where
                self.beats[m] = Beat(hb["seq"], *where, seen_at=now,
                                     progress_at=now if moved else old.progress_at)

    def _remove(self, verdicts: dict[int, str]) -> None:
        new = self.membership.without(verdicts)
        # members/{e} before epoch: a reader that sees the new epoch always finds its member list
        self.store.set(keys.members(new.epoch), json.dumps(list(new.members)))
        for m, reason in sorted(verdicts.items()):
            self.store.set(keys.dead(m), json.dumps({"epoch": new.epoch, "reason": reason}))
            for j in self.ranks:  # each rank's next beat's compare-and-set fails: they leave
                self.store.set(keys.heartbeat(m, j), FENCED)
            self.log.emit("member_dead", replica=m, epoch=new.epoch, reason=reason)
            self.slowness.forget(m)
        self._begin(new)

    def _admit(self) -> None:
        """Groups that asked to join (`join/{g}`: restarted by torchrun, or new on a spare host) and are
        not members: a new epoch with them (policy.membership.admit). Their old incarnation's marks go
        (dead, exit, heartbeats), so they beat afresh; they train from the first step planned in the
        new epoch, healed by a donor (trainer/step.py). One check per non-member a beat round."""
        requests = {}
        for g in range(self.replicas):
            if g not in self.membership.members and self.store.check([keys.join(g)]):
                requests[g] = json.loads(self.store.get(keys.join(g)))
        members, epoch = list(self.membership.members), self.membership.epoch
        for g, request in sorted(requests.items()):
            # survivors of a group that lost ranks (parallel.on_rank_loss=replan): the scheduler decides
            if "alive" in request and self.slowness.rank_lost(g, request["alive"], members, epoch) != "shrink":
                self.store.set(keys.admitted(g, request["nonce"]), "-1")  # refused: the survivor leaves
                self.store.delete_key(keys.join(g))
                del requests[g]
            elif "alive" not in request:  # a whole group: one that ran shrunk is back at its full plan
                self.slowness.ranks_back(g, members, epoch)
        if not requests:
            return
        new = self.membership.admit(requests)
        self.store.set(keys.members(new.epoch), json.dumps(list(new.members)))
        for g, request in sorted(requests.items()):
            for key in (keys.dead(g), keys.exited(g), keys.join(g), *(keys.heartbeat(g, j) for j in self.ranks)):
                self.store.delete_key(key)
            for j in self.ranks:
                self.beats.pop((g, j), None)
            self.store.set(keys.joined(g), str(new.epoch))
            self.store.set(keys.admitted(g, request["nonce"]), str(new.epoch))
            self.log.emit("join", replica=g, epoch=new.epoch, restart=request.get("restart", 0),
                          **({"shrunk": True, "alive": request["alive"]} if "alive" in request else {}))
        self._begin(new, admitted=sorted(requests))

    def _reform(self) -> None:
        """A member whose epoch's group broke while nobody died asked for a fresh one (`reform/{e}`,
        membership.request_reform): the same members in a new epoch."""
        key = keys.reform(self.membership.epoch)
        if self.store.check([key]):
            committed = last_committed(self.store)
            same = self._reforms[0] == (self.membership.members, committed)
            self._reforms = ((self.membership.members, committed), self._reforms[1] + 1 if same else 1)
            leaves = self.membership.cut_apart(self._reforms[1])
            if leaves is not None:  # the same members re-formed without a commit: they cannot reach each other
                self._reforms = (None, 0)
                group = list(self.membership.members)
                self._remove({leaves: f"the group of {group} broke {REFORMS_BEFORE_LEAVING} times in a row, "
                                      "no step committed: cut apart from its peers"})
                return
            new = self.membership.reformed()
            self.store.set(keys.members(new.epoch), json.dumps(list(new.members)))
            self._begin(new, reform=json.loads(self.store.get(key))["reason"])

    def _begin(self, new: Membership, **why) -> None:
        """Publish epoch `new` (its member list already written) and wake the members."""
        self.store.set(keys.epoch(), str(new.epoch))
        self.store.set(keys.epoch_begun(new.epoch), "1")  # wakes the members' epoch watches
        self.log.emit("epoch", epoch=new.epoch, members=list(new.members), **why)
        self.membership = new

    def drain(self) -> None:
        """Read the committed steps the detector has not read yet (a few reads when there are none). Call
        once the members finished, before the coordinator stops: beat rounds read steps only every
        `beat_every` s, so the run's last steps would go unread, and with them the measurement of a
        re-plan decided a few steps before the end (a grow back measured over the run's last 3 steps)."""
        self.slowness.poll(self.membership.epoch)

    def all_finished(self) -> bool:
        """Whether every member of the current epoch has applied the last step (as last read)."""
        return bool(self.membership.members) and set(self.membership.members) <= self.finished[1]

    def fail(self) -> None:
        record = {"reason": "every replica was lost", "last_committed_step": last_committed(self.store)}
        self.store.set(keys.failed(), json.dumps(record))
        self.log.emit("run_failed", **record)


def serve(store: TCPStore, address: str, replicas: int, log: EventLog, make: Callable[[Store], Coordinator],
          poll_s: float, until_finished: bool = False, exporter: Exporter | None = None) -> int:
    """Run the coordinator's loop on `store` (its server). Returns the exit code.

    Under the local launcher (`until_finished` False) it serves until the launcher writes `shutdown`,
    and starts a fresh membership whenever the launcher starts a generation. Standalone (`unbroken
    coordinator`), it ends by itself: 0 once every member finished its last step, 1 once every member
    was lost (the `failed` record says the last committed step). `exporter` (metrics.py) is polled every
    round and closed at the end."""
    try:
        return _loop(store, address, make, poll_s, until_finished, exporter)
    finally:
        if exporter is not None:
            exporter.poll(force=True)
            exporter.close()


def _loop(store: TCPStore, address: str, make: Callable[[Store], Coordinator], poll_s: float,
          until_finished: bool, exporter: Exporter | None) -> int:

    def client():
        return connect(address)

    def fresh(generation: int) -> Coordinator:
        # A whole-job restart (launcher) starts a generation: new membership under its own prefix.
        return make(PrefixStore(keys.generation_prefix(generation), store))

    # The launcher wakes this loop after it reports an exit, starts a generation or ends the run
    # (watch.wake); otherwise it runs a liveness round every `poll_s`.
    wakes = WakeWatch(client(), reconnect=client)
    generation = int(read(store, keys.generation()) or 0)  # not 0 for a standby taking over after a restart
    coord, alive, rounds, seen = fresh(generation), True, 0, wakes.current
    while True:
        rounds += 1
        woken, seen = wakes.current != seen, wakes.current
        if woken or rounds % 10 == 0:  # (every tenth round too: a wake lost to a launcher's crash)
            if store.check([keys.shutdown()]):
                if alive:
                    coord.drain()
                return 0
            if store.check([keys.generation()]) and int(store.get(keys.generation())) != generation:
                generation = int(store.get(keys.generation()))
                coord, alive = fresh(generation), True
        if alive and not coord.poll(time.monotonic(), exits=woken):
            coord.fail()
            alive = False
            if until_finished:
                return 1
        if until_finished and coord.all_finished():
            return 0
        if exporter is not None:
            exporter.poll()
        wakes.wait_until(lambda: wakes.current != seen, poll_s)


def main(argv: list[str] | None = None) -> int:
    """The coordinator under the local launcher (launch.py starts it with these flags)."""
    ap = argparse.ArgumentParser(prog="unbroken-coordinator")
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--group-size", type=int, default=1, help="ranks per replica group")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--heartbeat-timeout", type=float, default=1.5)
    ap.add_argument("--progress-timeout", type=float, default=20.0)
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--quotas", choices=QUOTAS, default="speed")
    ap.add_argument("--plan", default="", help="TP,PP,LAYERS,WIDTH,MICROBATCHES,STEPS,REFORM_S,EVICT,TP_BPS,PP_BPS,"
                    "PEER_BPS,STATE_BUDGET,LOCATE_STEPS (replan.GroupShape) of every group: re-plan groups turning "
                    "Slow with the scheduler (empty: quotas follow speed without it)")
    ap.add_argument("--reform-refused", default="", help="why a group that loses a rank cannot re-form onto "
                    "fewer ranks (the scheduler then applies drop and says so); empty: it can")
    ap.add_argument("--detector", default="", help="config [detector] as JSON (empty: the detector's defaults)")
    ap.add_argument("--poll", type=float, default=0.1, help="s between liveness rounds (unless woken)")
    ap.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)")
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--tensorboard", default="", help="write TensorBoard event files to this directory")
    ap.add_argument("--wandb", default="", help="log to this Weights & Biases project (trackers.py)")
    ap.add_argument("--checkpoint-dir", default="", help="where to look for the newest complete checkpoint")
    ap.add_argument("--store", default="", help="etcd://...: the run's state lives there (else: serve a TCPStore)")
    ap.add_argument("--lease-ttl", type=int, default=5, help="s: with etcd, a standby leads this long after a death")
    ap.add_argument("--listen-fd", type=int, default=None,
                    help="serve on this socket, bound to --port and listening (the launcher holds the port)")
    a = ap.parse_args(argv)
    log = EventLog(f"{a.run_dir}/events.jsonl", who="coordinator")
    shape = parse_shape(a.group_size, a.plan, a.reform_refused or None) if a.plan else None
    detector = DetectorSection(**json.loads(a.detector)) if a.detector else None
    if a.store:  # several coordinators may serve the run: the one holding the lease leads, the rest wait
        store, address = connect(a.store), a.store
        from unbroken.runtime.coordinator.election import lead

        def deposed() -> None:  # a write found another coordinator leading: stop before doing anything else
            log.emit("coordinator_deposed", pid=os.getpid())
            os._exit(3)
        leadership, waited = lead(store, a.lease_ttl, deposed)
        current = PrefixStore(keys.generation_prefix(int(read(store, keys.generation()) or 0)), store)
        log.emit("coordinator_leads", pid=os.getpid(), host=socket.gethostname(), waited=round(waited, 3),
                 previous=leadership.previous,  # takeover: a standby took over a running membership
                 takeover=current.check([keys.epoch()]))
    else:
        store = TCPStore(a.host, a.port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60), use_libuv=True, master_listen_fd=a.listen_fd)
        address = f"{a.host}:{store.port}"
    print(f"UNBROKEN_STORE={address}", flush=True)
    # what the run is doing, for operators: /metrics, TensorBoard, the store's status snapshot
    exporter = Exporter(a.run_dir, store, a.metrics_port, a.metrics_host, a.tensorboard, a.checkpoint_dir,
                        wandb=a.wandb)
    return serve(store, address, a.replicas, log,
                 lambda s: Coordinator(s, a.replicas, log, a.heartbeat_timeout, a.progress_timeout,
                                       a.startup_timeout, quotas=a.quotas, beat_every=a.poll,
                                       group_size=a.group_size, shape=shape, detector=detector),
                 a.poll, exporter=exporter)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the wake watch's thread blocks in a C++ store wait: no interpreter shutdown
