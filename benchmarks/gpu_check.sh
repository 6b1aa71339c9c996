#!/usr/bin/env bash
# What a session with a GPU machine runs, in one go (the device tool's machine: a python3 that holds
# torch and pytest, no network; this checkout on PYTHONPATH instead of an install). Writes its logs under
# ${OUT:-/tmp/gpu_check}. Each part has its own time limit, so one hang does not take the rest. Parts,
# named as arguments (default: all but hsdp, in this order): tests dup exact demo hsdp
#   bash benchmarks/gpu_check.sh [PART ...]
set -u
parts=" ${*:-tests dup exact demo} "
want() { [[ $parts == *" $1 "* ]]; }
out=${OUT:-/tmp/gpu_check}; mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
if want tests; then
echo "== the gpu tests and the device unit tests"
timeout 240 $py -m pytest tests/runtime/test_device.py tests/runtime/test_devicetime.py -n 0 -o addopts="" -q -rA \
  -p no:cacheprovider 2>&1 | tee "$out/pytest.txt" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" | cut -c1-300
fi
if want dup; then
echo "== two ranks of one NCCL communicator on one GPU (what check_gpus refuses up front)"
cat > /tmp/dup.py <<'PY'
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl")
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("rank", dist.get_rank(), "all_reduce on a shared GPU gave", t.tolist())
dist.destroy_process_group()
PY
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
