#!/usr/bin/env bash
# What a session with a GPU machine runs, in one go (the device tool's machine: a python3 that holds
# torch and pytest, no network; this checkout on PYTHONPATH instead of an install). Writes its logs under
# ${OUT:-/tmp/gpu_check}. Each part has its own time limit, so one hang does not take the rest. Parts,
# named as arguments (default: tests hostid abort ftnccl fsdpnccl events; the rest by name):
#   tests     the gpu tests and the device / NCCL-machine unit tests
#   hostid    two NCCL ranks of one communicator on one GPU, each its own NCCL_HOSTID (NEVER RUN)
#   abort     NcclEpochGroup on a real GPU: a hung peer aborted, re-form, timeout (gpu_nccl_abort.py; NEVER RUN)
#   ftnccl    (a) 3 one-rank groups, --parallel.device=cuda --parallel.cross_backend=nccl --exact, a kill, a
#             hang and the rejoins: `unbroken compare` against the failure-free run (NEVER RUN on a GPU;
#             the same flags with --parallel.device=cpu --parallel.cross_backend=gloo on the 2-core CPU
#             machine: 36/36 steps identical, replicas 1 and 2 lost and both rejoined)
#   fsdpnccl  (b) 2 groups x 2 ranks, FSDP2 inside and the cross-group reduction, all on NCCL, a rank lost
#             and its group rejoining: the same comparison (NEVER RUN)
#   events    (c) every rank of ftnccl's and fsdpnccl's runs recorded cuda:N and an NCCL version (NEVER RUN)
#   figures   (d) issue 63's ratios (gpu_figures.py; NEVER RUN; the device digest and heals on NCCL are not
#             built, it says so)
#   dup exact demo hsdp: as before (dup: two ranks on one GPU without NCCL_HOSTID, what check_gpus refuses)
#   bash benchmarks/gpu_check.sh [PART ...]
#
# Several NCCL ranks on ONE GPU: NCCL refuses two ranks of one communicator whose host identity and bus id
# match ("Duplicate GPU detected"); NCCL_HOSTID overrides the host identity (torchft's train_ddp.py). The
# local launcher starts one torchrun per group, and torchrun gives all of a job's ranks one environment, so
# the rank sets its own: with UNBROKEN_NCCL_HOSTID_PER_RANK=1 exported here, each trainer sets
# NCCL_HOSTID=unbroken-g{group}-r{rank} at its start, before any NCCL call (runtime/parallel/device.py:
# hostid_per_rank), and a group may have more ranks than the host has GPUs (check_gpus stands aside).
# The standalone scripts (hostid, abort, figures) set NCCL_HOSTID per process themselves. With several
# GPUs, rank r of group g takes GPU (g x group_size + r) modulo the GPUs, one rank per GPU where they
# suffice. Functional tests only: ranks sharing a GPU say nothing of speed but the ratios' own.
set -u
parts=" ${*:-tests hostid abort ftnccl fsdpnccl events} "
want() { [[ $parts == *" $1 "* ]]; }
out=${OUT:-/tmp/gpu_check}; mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
if want tests; then
echo "== the gpu tests and the device unit tests"
timeout 300 $py -m pytest tests/runtime/parallel/test_device.py tests/runtime/trainer/test_devicetime.py tests/runtime/parallel/test_nccl_machine.py -n 0 -o addopts="" -q -rA \
  -p no:cacheprovider 2>&1 | tee "$out/pytest.txt" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" | cut -c1-300
fi
# two ranks of one NCCL communicator on GPU 0 (the dup and hostid parts)
cat > /tmp/dup.py <<'PY'
import os
if os.environ.get("HOSTID_PER_RANK"):  # the hostid part: each rank its own NCCL_HOSTID, before any NCCL call
    os.environ["NCCL_HOSTID"] = f"hostid-check-{os.environ['LOCAL_RANK']}"
import torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("rank", dist.get_rank(), "all_reduce on a shared GPU gave", t.tolist())
dist.destroy_process_group()
PY
if want dup; then
echo "== two ranks of one NCCL communicator on one GPU (what check_gpus refuses up front)"
timeout 60 $py -m torch.distributed.run --nproc-per-node=2 /tmp/dup.py > "$out/dup.txt" 2>&1; echo "rc=$?"
grep -iE "duplicate|gave|error" "$out/dup.txt" | sort | uniq -c | head -5 | cut -c1-300
fi
if want exact; then
echo "== gradients' bits and the cost of exact kernels"
timeout 150 $py benchmarks/gpu_exact.py --repeats 6 2>&1 | tee "$out/gpu_exact.txt"
fi
if want demo; then
echo "== the demo on CUDA (4 one-rank replicas on one GPU, --exact)"
timeout 200 $py -m unbroken.cli demo --out "$out/demo_run" > "$out/demo.txt" 2>&1; echo "rc=$?"
grep -E "identical|plot|faulty:|reference:|error" "$out/demo.txt"
cp "$out/demo_run/report.png" "$out/demo_report.png" 2>/dev/null
rm -rf "$out/demo_run"
fi
if want hsdp; then
# unbroken's HSDP overhead where the host has cores to spare (a GPU node's case): 2 groups x 2 ranks on
# CPU gloo, as on the 2-core development machine, where 4 trainers and the control plane share 2 cores
echo "== hsdp_overhead on $(nproc) cores (CPU gloo, no GPU)"
# a round took ~9.8 s on the H200 machine's host (2 windows of 4 s and the freezing), start-up ~15 s
rounds=${HSDP_ROUNDS:-20}
CUDA_VISIBLE_DEVICES= timeout $((40 + 12 * rounds)) $py benchmarks/hsdp_overhead.py --rounds "$rounds" 2>&1 \
  | tee "$out/hsdp_overhead.txt" | grep -E "ratio|pooled|by round"
fi
runs=${RUNS:-/tmp/gpu_check_runs}; mkdir -p "$runs"  # run directories stay off $OUT (its size is limited)
# one line per run: fault and join counts, and every step's members (what a kill, hang and rejoin did)
summary() { $py - "$1" <<'PY'
import os, sys
from unbroken.events import read_events
if not os.path.exists(sys.argv[1] + "/events.jsonl"):
    sys.exit(f"{sys.argv[1]}: no events.jsonl")
ev = read_events(sys.argv[1] + "/events.jsonl")
faults = [(e.get("kind"), e.get("replica"), e.get("rank"), e.get("step")) for e in ev if e["event"] == "fault"]
joins = [e.get("replica") for e in ev if e["event"] == "join"]
members = {e["step"]: e.get("members") for e in ev if e["event"] == "step"}
print(f"{sys.argv[1]}: faults {faults} joins {joins} members by step {members}")
PY
}
# a failure-free run and a faulty one with the same flags; the faulty one's digests must be the reference's
same_as_reference() {  # NAME TIMEOUT FAULTS FLAGS...
  local name=$1 limit=$2 faults=$3; shift 3
  rm -rf "$runs/$name-ref" "$runs/$name"
  timeout "$limit" $py -m unbroken.cli train "$@" --out "$runs/$name-ref" > "$out/$name-ref.txt" 2>&1
  echo "$name reference rc=$?"
  timeout "$limit" $py -m unbroken.cli train "$@" --faults "$faults" --out "$runs/$name" > "$out/$name.txt" 2>&1
  echo "$name faulty rc=$?"
  $py -m unbroken.cli compare "$runs/$name-ref" "$runs/$name" > "$out/$name-compare.txt" 2>&1
  echo "$name compare rc=$? $(tail -n 1 "$out/$name-compare.txt")"
  $py -m unbroken.cli audit "$runs/$name" 2>&1 | tail -n 1
  summary "$runs/$name" | cut -c1-600
}
if want hostid; then
echo "== two ranks of one NCCL communicator on one GPU, each its own NCCL_HOSTID"
HOSTID_PER_RANK=1 timeout 90 $py -m torch.distributed.run --nproc-per-node=2 /tmp/dup.py > "$out/hostid.txt" 2>&1; echo "rc=$?"
grep -iE "duplicate|gave|error" "$out/hostid.txt" | sort | uniq -c | head -5 | cut -c1-300
fi
if want abort; then
echo "== NcclEpochGroup: a hung peer aborted from a watcher thread, re-formed without it, a timeout"
timeout 240 $py benchmarks/gpu_nccl_abort.py 2>&1 | tee "$out/abort.txt" | grep -vE "^\s*$" | cut -c1-300
fi
export UNBROKEN_NCCL_HOSTID_PER_RANK=1  # the runs below put several NCCL ranks on one GPU
FT=(--parallel.device=cuda --parallel.cross_backend=nccl --exact --launch.progress=false --launch.launcher=torchrun --launch.restarts=1
    --coord.heartbeat_timeout=5 --coord.heartbeat_interval=0.2 --coord.collective_timeout=30
    --coord.run_timeout=400 --model.dropout=0)
if want ftnccl; then
echo "== (a) 3 one-rank groups on NCCL, --exact: a kill, a hang, both rejoin; digests against the failure-free run"
# replica 0 sleeps after each compute (wall time only) so that the restarted groups find steps left
same_as_reference ftnccl 300 "kill:replica=1,step=2,phase=allreduce; hang:replica=2,step=5,phase=compute,for=12; slow:replica=0,from=3,to=30,for=0.4" \
  --replicas 3 --steps 36 --microbatches 6 "${FT[@]}"
fi
if want fsdpnccl; then
echo "== (b) 2 groups x 2 ranks, FSDP2 and the cross-group reduction on NCCL: a rank lost, its group rejoins"
same_as_reference fsdpnccl 300 "kill:replica=1,rank=1,step=2,phase=compute; slow:replica=0,from=0,to=24,for=0.6" \
  --replicas 2 --parallel.group_size=2 --steps 30 --microbatches 4 "${FT[@]}"
fi
if want events; then
echo "== (c) every rank's worker_start: cuda:N, its name, an NCCL version, cross_backend nccl"
$py - "$runs"/ftnccl "$runs"/ftnccl-ref "$runs"/fsdpnccl "$runs"/fsdpnccl-ref <<'PY' 2>&1 | tee "$out/events.txt"
import os, sys
from unbroken.events import read_events
bad = 0
for run in sys.argv[1:]:
    if not os.path.exists(run + "/events.jsonl"):
        print(f"{run}: no events (its part did not run)"); bad += 1; continue
    starts = [e for e in read_events(run + "/events.jsonl") if e["event"] == "worker_start"]
    wrong = [e for e in starts if not (e["device"].startswith("cuda:") and e["nccl"] and e["cross_backend"] == "nccl")]
    bad += len(wrong) + (not starts)
    seen = sorted({(e["device"], e["device_name"], e["nccl"], e["cross_backend"]) for e in starts})
    print(f"{run}: {len(starts)} rank starts, {len(wrong)} not on CUDA and NCCL; {seen}")
print("events:", "ok" if not bad else f"FAILED ({bad})")
PY
fi
if want figures; then
echo "== (d) issue 63's figures (ratios in one run)"
timeout 540 $py benchmarks/gpu_figures.py 2>&1 | tee "$out/figures.txt" | grep -E "ratio|figure|ms|Error" | cut -c1-300
fi
