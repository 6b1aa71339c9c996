"""docs/cluster.md's lines on three hosts made of Linux namespaces (hosts.py), and what a network does to
them: a group's host cut off for a while. Each run's digests are compared with the failure-free local run
(--exact), and each fault is asserted from the event log to have fired and had its effect. Skipped in one
line where namespaces cannot be made (not root)."""
from __future__ import annotations

import re

import pytest

from tests.cluster.cluster_run import digests, doc_lines, start
from tests.cluster.hosts import sh
from tests.conftest import unbroken
from unbroken.events import read_events

# the partition run: long enough (a fixed 0.1 s stall after each microbatch's compute, on both groups,
# which changes no bit) that the survivor still trains when the cut host comes back
LONG = ["--run.steps=40", "--coord.heartbeat_timeout=3",
        "--run.faults=slow:replica=0,from=0,for=0.1; slow:replica=1,from=0,for=0.1"]


_REFERENCES: dict[int, dict[int, str]] = {}


def reference(tmp_path, steps: int) -> dict[int, str]:
    """The failure-free run of the documented coordinator's `--run.` flags through `unbroken train`, for
    `steps` steps; run once per test process and length."""
    if steps not in _REFERENCES:
        flags = [a for a in doc_lines()[0].split() if a.startswith("--run.")] + [f"--run.steps={steps}"]
        out = tmp_path / f"reference{steps}"
        r = unbroken("train", *flags, "--run.progress=false", "--out", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        _REFERENCES[steps] = digests(read_events(out))
    return _REFERENCES[steps]


@pytest.mark.timeout(150)
def test_the_documented_lines_on_three_hosts_match_the_local_run_bitwise(hosts, tmp_path):
    """Coordinator on host 0 (`--host` its address), group 0's torchrun on host 1, group 1's forkrun on
    host 2: every worker finds the interface that reaches the coordinator by itself (no
    GLOO_SOCKET_IFNAME given), and the run is the local launcher's, bit for bit."""
    cluster = hosts(3)
    run = start(cluster, tmp_path)
    assert run.wait(120) == 0, run.tail()
    assert [g.returncode for g in run.groups] == [0, 0], run.tail()
    evs = run.events()
    started = {e["replica"]: e for e in evs if e["event"] == "worker_start"}
    assert {g: e["interface"] for g, e in started.items()} == {0: "eth0", 1: "eth0"}
    ref = reference(tmp_path, 6)
    assert digests(evs) == ref and sorted(ref) == list(range(6))
    print(f"3 hosts ({', '.join(h.address for h in cluster.hosts)}): 6/6 steps bitwise the local run; "
          f"gloo bound eth0 on both group hosts")


@pytest.mark.timeout(200)
def test_a_partitioned_host_is_declared_dead_fenced_when_back_and_rejoins_by_healing(hosts, tmp_path):
    """Host 2's link down for 8 s after step 3: group 1 keeps computing, is declared dead after the 3 s
    heartbeat timeout, the survivor redoes its microbatches; when the link returns group 1 is fenced (it
    commits nothing, exit 3 with its event, not a traceback), torchrun restarts it and it rejoins by
    healing; every digest is the failure-free run's."""
    cluster = hosts(3)
    run = start(cluster, tmp_path, LONG, restarts=1, faults="partition:host=2,step=3,for=8")
    assert run.wait(150) == 0, run.tail()
    evs = run.events()
    (fired,) = [e for e in evs if e["event"] == "fault"]
    (ended,) = [e for e in evs if e["event"] == "fault_end"]
    assert (fired["kind"], fired["host"], fired["step"]) == ("partition", 2, 3)
    cut, mended = fired["t"], ended["t"]
    (dead,) = [e for e in evs if e["event"] == "member_dead"]
    assert dead["replica"] == 1 and "no heartbeat" in dead["reason"] and cut < dead["t"] < mended
    (recovery,) = [e for e in evs if e["event"] == "recovery" and e["replica"] == 0]
    assert recovery["to_epoch"] == dead["epoch"] and recovery["redo"]  # the survivor redid its microbatches
    (fenced,) = [e for e in evs if e["event"] == "fenced"]
    kept = [e for e in evs if e["event"] == "compute" and e["replica"] == 1 and cut <= e["t"] < fenced["t"]]
    assert fenced["replica"] == 1 and fenced["t"] >= mended and "declared dead" in fenced["reason"]
    # fenced: nothing of group 1 applied or committed between its death and its rejoin
    (join,) = [e for e in evs if e["event"] == "join"]
    assert join["replica"] == 1 and join["t"] > fenced["t"]
    assert not [e for e in evs if e["event"] in ("applied", "decision") and e.get("replica") == 1
                and dead["t"] <= e["t"] < join["t"]]
    heals = [e for e in evs if e["event"] == "heal" and e["side"] == "joiner"]
    assert [h["replica"] for h in heals] == [1] and heals[0]["bytes"] > 0
    restarted = [e for e in evs if e["event"] == "worker_start" and e["replica"] == 1]
    assert [e["restart"] for e in restarted] == [0, 1]
    log = (tmp_path / "logs" / "group1.log").read_text()
    assert "DistNetworkError" not in log and "exit code 3" in log  # its agent saw the fenced exit, no traceback
    ref = reference(tmp_path, 40)
    assert digests(evs) == ref and sorted(ref) == list(range(40))
    print(f"host 2 cut for {mended - cut:.1f} s after step 3: group 1 declared dead ({dead['reason']}), "
          f"{len(kept)} microbatches computed while cut off, redo {recovery['redo']} by group 0, fenced at the "
          f"link's return, rejoined in epoch {join['epoch']} healed at step {heals[0]['step']} "
          f"({heals[0]['bytes']} bytes); 40/40 digests bitwise the failure-free run")


@pytest.mark.timeout(200)
def test_a_cut_between_two_groups_that_reach_the_coordinator_is_decided_within_its_bound(hosts, tmp_path):
    """Hosts 1 and 2 cut apart after step 3 (blackhole routes in both), each still reaching the coordinator:
    no step hangs; the group's collective fails, a re-formed epoch fails to form, and at the second break in
    a row without a commit the coordinator makes the higher id leave (policy.membership.cut_apart), within
    collective_timeout + 3 x (2 x heartbeat_timeout); the survivor goes on exact; once the cut heals the
    group that left (restarted by torchrun) rejoins by healing."""
    cluster = hosts(3)
    hb, collective = 2, 5
    run = start(cluster, tmp_path, [*LONG, f"--coord.heartbeat_timeout={hb}",
                                    f"--coord.collective_timeout={collective}"], restarts=1)
    run.until(run.committed(3), 120)
    cluster.split(1, 2)
    cut = run.events()[-1]["t"]
    evs = run.until(lambda evs: any(e["event"] == "member_dead" for e in evs), 90)
    cluster.join(1, 2)
    (dead,) = [e for e in evs if e["event"] == "member_dead"]
    bound = collective + 3 * 2 * hb
    assert dead["replica"] == 1 and "cut apart" in dead["reason"] and dead["t"] - cut <= bound, (dead, cut)
    assert run.wait(150) == 0, run.tail()
    evs = run.events()
    failed = [e for e in evs if e["event"] == "reduce" and not e["ok"] and e["t"] >= cut]
    assert {e["replica"] for e in failed} >= {1}  # the cut fired: group 1's collectives failed across it
    reforms = [e for e in evs if e["event"] == "epoch" and "reform" in e and cut <= e["t"] <= dead["t"]]
    assert len(reforms) == 1  # one re-form forgiven, the second break decided
    (join,) = [e for e in evs if e["event"] == "join"]
    heals = [e for e in evs if e["event"] == "heal" and e["side"] == "joiner"]
    assert join["replica"] == 1 and [h["replica"] for h in heals] == [1]
    ref = reference(tmp_path, 40)
    assert digests(evs) == ref and sorted(ref) == list(range(40))
    print(f"hosts 1 and 2 cut apart: group 1 left {dead['t'] - cut:.1f} s after the cut (bound {bound} s: "
          f"{dead['reason']}), rejoined in epoch {join['epoch']} healed at step {heals[0]['step']}; "
          f"40/40 digests bitwise the failure-free run")


@pytest.mark.timeout(150)
def test_groups_that_cannot_reach_each_other_end_within_a_bound_naming_the_address_tried(hosts, tmp_path):
    """What the documented lines did before a worker found its interface, forced: gloo bound to loopback
    (GLOO_SOCKET_IFNAME=lo) on both group hosts, so each advertises 127.0.0.1 and no group reaches the other.
    No hang: the cross-group group never forms, and within collective_timeout + 3 x (2 x heartbeat_timeout)
    of its first failure the higher id leaves with one line naming the address it tried; the lower id
    finishes the run alone (exit 0), still exact."""
    cluster = hosts(3)
    hb, collective = 2, 5
    run = start(cluster, tmp_path, [f"--coord.heartbeat_timeout={hb}", f"--coord.collective_timeout={collective}"],
                group_env={"GLOO_SOCKET_IFNAME": "lo"})
    assert run.wait(120) == 0, run.tail()
    evs = run.events()
    assert {e["replica"]: e["interface"] for e in evs if e["event"] == "worker_start"} == {0: "lo", 1: "lo"}
    failed = [e for e in evs if e["event"] == "reduce" and not e["ok"]]
    (dead,) = [e for e in evs if e["event"] == "member_dead"]
    bound = collective + 3 * 2 * hb
    assert dead["replica"] == 1 and "cut apart" in dead["reason"] and dead["t"] - failed[0]["t"] <= bound
    assert [e["replica"] for e in evs if e["event"] == "fenced"] == [1]
    said = [line for line in (tmp_path / "logs" / "group1.log").read_text().splitlines()
            if line.startswith("unbroken: error:")]
    # the address it names is the last one gloo's errors named (a failure can come without one: a timeout)
    named = re.findall(r"remote=\[([^\]]+)\]:(\d+)", " ".join(e["error"] for e in failed if e["replica"] == 1))
    assert len(said) == 1 and "cannot reach its peers" in said[0], said
    if named:  # the line names it
        assert f"tried {named[-1][0]}:{named[-1][1]}" in said[0] and named[-1][0] == "127.0.0.1", (said, named)
    else:  # no failure named a peer (a timeout): the line says so, with gloo's words
        assert "without naming a peer address" in said[0], said
    print(f"the failed collectives named {named[-1] if named else 'no peer address'}")
    assert run.groups[1].returncode != 0 and run.groups[0].returncode == 0
    ref = reference(tmp_path, 6)
    assert digests(evs) == ref
    print(f"gloo on loopback: group 1 left {dead['t'] - failed[0]['t']:.1f} s after the first failed collective "
          f"(bound {bound} s), saying: {said[0]}; group 0 finished 6/6 bitwise the failure-free run")


@pytest.mark.timeout(150)
def test_the_coordinators_host_cut_off_ends_the_run_cleanly(hosts, tmp_path):
    """Host 0 (the coordinator, its embedded store) cut off after step 3: the coordinator hears no group
    and ends the run (exit 1, one error line with the last committed step, and the summary); each group,
    its beats no longer coming back, leaves fenced within coord.progress_timeout with one line naming the
    coordinator's address, not a hang or a traceback."""
    cluster = hosts(3)
    run = start(cluster, tmp_path, ["--coord.heartbeat_timeout=2", "--coord.progress_timeout=6", *LONG[2:]])
    run.until(run.committed(3), 120)
    cluster.cut(0)
    assert run.wait(90) == 1, run.tail()
    evs = run.events()
    dead = [e for e in evs if e["event"] == "member_dead"]
    assert sorted(e["replica"] for e in dead) == [0, 1] and all("no heartbeat" in e["reason"] for e in dead)
    (failed,) = [e for e in evs if e["event"] == "run_failed"]
    said = (tmp_path / "logs" / "coordinator.log").read_text().splitlines()
    assert f"unbroken: error: every replica group was lost; last committed step: {failed['last_committed_step']}" \
        in said and any(line.startswith("run dir: ") for line in said)
    assert (tmp_path / "run" / "summary.json").is_file()
    fenced = [e for e in evs if e["event"] == "fenced"]
    assert sorted(e["replica"] for e in fenced) == [0, 1]
    address = cluster.hosts[0].address
    for g in (0, 1):
        log = (tmp_path / "logs" / f"group{g}.log").read_text()
        lines = [line for line in log.splitlines() if line.startswith("unbroken: error:")]
        assert len(lines) == 1 and f"cut off from the coordinator at {address}:29400" in lines[0], log[-2000:]
        assert "DistNetworkError" not in log
        assert run.groups[g].returncode != 0
    ref = reference(tmp_path, 6)
    committed = digests(evs)
    assert committed and all(committed[s] == ref[s] for s in committed)
    print(f"coordinator's host cut off: run ended (exit 1) at last committed step {failed['last_committed_step']}, "
          f"both groups fenced with one line each ({lines[0]})")


@pytest.mark.timeout(150)
def test_a_lost_host_takes_every_process_and_its_memory_and_the_survivor_goes_on_exact(hosts, tmp_path):
    """Host 2 lost after step 2 (its PID namespace's init killed: group 1's torchrun agent and worker die
    with it, nothing reports the exit, its private /dev/shm goes with the last process holding it): the
    coordinator declares group 1 dead by its heartbeats alone, the survivor redoes its microbatches and
    the run ends exact."""
    cluster = hosts(3)
    lost = cluster.hosts[2]
    assert lost.run(["sh", "-c", "echo held > /dev/shm/ub71-marker"]).returncode == 0
    assert cluster.hosts[1].run(["ls", "/dev/shm/ub71-marker"]).returncode != 0  # each host's own memory
    run = start(cluster, tmp_path, ["--coord.heartbeat_timeout=2", *LONG[2:]], faults="host:host=2,step=2")
    assert run.wait(120) == 0, run.tail()
    assert not lost.alive() and sh("ip", "netns", "pids", lost.netns).stdout.split() == []
    assert lost.run(["ls", "/dev/shm/ub71-marker"]).returncode != 0  # no namespace left to enter
    evs = run.events()
    (fired,) = [e for e in evs if e["event"] == "fault"]
    assert (fired["kind"], fired["host"], fired["step"]) == ("host", 2, 2)
    (dead,) = [e for e in evs if e["event"] == "member_dead"]
    assert dead["replica"] == 1 and "no heartbeat" in dead["reason"] and dead["t"] > fired["t"]
    (recovery,) = [e for e in evs if e["event"] == "recovery" and e["replica"] == 0]
    assert recovery["redo"]
    assert run.groups[1].returncode != 0 and run.groups[0].returncode == 0
    ref = reference(tmp_path, 6)
    assert digests(evs) == ref
    print(f"host 2 lost after step 2: no process left in its namespaces, group 1 declared dead "
          f"({dead['reason']}), redo {recovery['redo']} by group 0; 6/6 digests bitwise the failure-free run")
