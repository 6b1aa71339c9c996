"""Experiment: can the survivors of a broken gloo default process group form a new default group in the
same processes and run a torch.distributed.pipelining schedule over it? 3 ranks; rank 1 dies with SIGKILL;
ranks 0 and 2 see the failure on a collective, destroy the old group, init a new one (world 2) from an
outside TCPStore under a fresh prefix, and run a 2-stage GPipe of a small MLP. Prints the seconds of each
phase and whether the pipeline's loss equals the one-process loss."""
import os, signal, sys, time, datetime
import torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

def worker(rank, port, outside, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=10))
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        q.put((rank, "no error?!")); return
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:80]}"
    t1 = time.monotonic()
    dist.destroy_process_group()
    t2 = time.monotonic()
    new = {0: 0, 2: 1}[rank]
    store = dist.PrefixStore("reform/1", dist.TCPStore("127.0.0.1", outside, is_master=False,
                                                       timeout=datetime.timedelta(seconds=10)))
    dist.init_process_group("gloo", store=store, rank=new, world_size=2, timeout=datetime.timedelta(seconds=10))
    t3 = time.monotonic()
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    m = model()
    part = m[:2] if new == 0 else m[2:]
    stage = PipelineStage(part, new, 2, torch.device("cpu"))
    loss_fn = lambda out, y: ((out - y) ** 2).mean()
    sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    losses = []
    if new == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=losses)
    t4 = time.monotonic()
    grads = [p.grad.double().tolist() for p in part.parameters()]
    q.put((rank, dict(error=err, detect=round(t1 - t0, 3), destroy=round(t2 - t1, 3), init=round(t3 - t2, 3),
                      pipeline=round(t4 - t3, 3), losses=[float(l.detach()) for l in losses], grads=grads)))
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    def free():
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
    outside = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    port = free()
    procs = [ctx.Process(target=worker, args=(r, port, outside.port, q)) for r in range(3)]
    for p in procs: p.start()
    got = dict(q.get(timeout=120) for _ in range(2))
    for p in procs: p.join(30)
    print("exit codes", [p.exitcode for p in procs])
    for r in (0, 2):
        print(r, {k: v for k, v in got[r].items() if k != "grads"})
    # one process: the same loss and grads (mean over microbatches of 2 rows each)
    m = model(); torch.manual_seed(1); x, y = torch.randn(4, 8), torch.randn(4, 4)
    ls = [((m(x[i:i+2]) - y[i:i+2]) ** 2).mean() for i in (0, 2)]
    sum(ls).backward()
    print("losses one-process", [float(l) for l in ls])
    ref = [p.grad / 2 for p in m.parameters()]  # the schedule scales grads by 1/n_microbatches (scale_grads)
    pipe = [torch.tensor(g, dtype=torch.float64).float() for g in got[0]["grads"] + got[2]["grads"]]
    print("grads equal bitwise:", all(torch.equal(a, b) for a, b in zip(ref, pipe)),
          "max diff", max(float((a - b).abs().max()) for a, b in zip(ref, pipe)))
