"""The config tree's shape: one frozen dataclass per section, each field with its type, default and doc.

Owns: every key of a run, its type (a `Literal[...]` for a key with a fixed set of values: tree.py
checks them all in one place), its default, and its help text, which is the string literal right after
the field (listing.py reads it for `unbroken config` and docs/config.md). Does not own: reading a file
or flags or the root `Config` and the checks across keys (tree.py), or what the values do.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    pass


def literal_problem(tp: Any, value: Any, where: str) -> str | None:
    """Why `value` does not fit type `tp` when that is a `Literal[...]` (None: it fits, or `tp` is no
    Literal): the one message every such key gives, naming the key, the value and the allowed values."""
    if typing.get_origin(tp) is not Literal or value in typing.get_args(tp):
        return None
    return f"{where}={value!r}: expected one of {', '.join(map(repr, typing.get_args(tp)))}"


@dataclass(frozen=True)
class ModelConfig:
    """The built-in model trained (a user's model factory reads what it likes): its shape and dropout."""
    arch: Literal["gpt", "llama"] = "gpt"
    """The built-in model: "gpt" (model/gpt.py: learned positions, LayerNorm, GELU MLP, tied head) or
    "llama" (model/llama.py, Llama 3's: RMSNorm, RoPE, grouped-query attention, SwiGLU, no dropout)."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; model.n_embd must be a multiple of it."""
    n_embd: int = 64
    """Width; parameters grow with n_layer * 12 * n_embd**2."""
    block_size: int = 64
    """Longest sequence the model takes, tokens."""
    vocab_size: int = 256
    """Token vocabulary: 256 is byte-level."""
    dropout: float = 0.1
    """gpt: dropout probability, seeded per microbatch (seed, step, i), never per rank (llama has none)."""
    n_kv_head: int = 0
    """llama: key/value heads (grouped-query attention), a divisor of model.n_head; 0: model.n_head."""
    ffn_dim_multiplier: float = 0.0
    """llama: the SwiGLU hidden width is 2/3 x 4 x n_embd times this (0: 1), rounded up to a multiple of
    256, as Llama 3 sizes it; model.intermediate_size, when set, instead."""
    intermediate_size: int = 0
    """llama: the SwiGLU hidden width (Hugging Face's name); 0: from model.ffn_dim_multiplier."""
    rope_theta: float = 10000.0
    """llama: the rotary embedding's base (Llama 3 uses 500000)."""
    tie_embeddings: bool = False
    """llama: the head shares the token embedding's weight (the GPT's always does)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute each block's activations in the backward instead of keeping them: "full" (every block),
    "selective" (every other block: torchtitan's layer-wise selective checkpointing at a frequency of 2)
    or "none". torch.utils.checkpoint (non-reentrant) around each block, inside its FSDP2 unit; dropout
    recomputes the same masks, so the trajectory is bitwise the one without."""
    compile: bool = False
    """torch.compile each block (the plan's layers) in place, as torchtitan does: after TP and activation
    checkpointing, before FSDP2, in every layout; a compiled run is bitwise its own failure-free compiled run
    under --exact (the survivors and a restarted, recompiled group compute the same). Not with a
    parallelize function of your own (compile in it); refused before start where model.compile_backend
    cannot run here."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """model.compile's backend: "inductor" (generated kernels: needs a C++ compiler on the CPU, Triton on a
    GPU), "aot_eager" (traced forward and backward graphs run by eager kernels: no code generation, quick
    to compile) or "eager" (Dynamo's tracing only)."""
    init_from: str = ""
    """A Hugging Face directory (config.json and model.safetensors, as `unbroken export --hf` writes) whose
    weights the run starts from instead of the seed's initialisation: continued pre-training, nothing
    downloaded. model.arch=llama (its config.json must describe [model]: checked before start) or a
    model built by unbroken.model.hf.causal_lm; loaded whole by every rank, then sharded as the plan
    shards it. Empty: none."""


@dataclass(frozen=True)
class DataConfig:
    """The training data and how it is cut into microbatches."""
    path: str = ""
    """Token files: a file or a glob of shards (quote it), memory-mapped: llm.c shards, Megatron-LM
    PREFIX.bin with PREFIX.idx, raw token arrays (.bin, as data.dtype says); or one text file, read as
    bytes; empty: the Python standard library's source."""
    format: Literal["auto", "llmc", "megatron", "raw"] = "auto"
    """The token files' format; auto: recognised from each file (a .idx beside it: Megatron; an llm.c
    magic: llm.c; other .bin: raw; anything else: text)."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Raw token files' token type (uint32 for vocabularies over 65,535); llm.c and Megatron files say
    theirs."""
    eos: int = -1
    """The end-of-document token id, marking document boundaries in token files (variable lengths end
    there; position ids restart after it); -1: none (Megatron files mark theirs in the index)."""
    batch_size: int = 4
    """Sequences per microbatch."""
    ignore_index: int = -1
    """The target id that marks padding (neither counted nor in the loss): -1, or Hugging Face's -100;
    the built-in models' losses take it."""
    seq_len: str = "64"
    """Tokens per sequence; "variable" or "MIN-MAX": lengths from document lengths."""
    max_files: int = 400
    """Default corpus: how many standard-library files to read."""


@dataclass(frozen=True)
class EvalConfig:
    """Validation loss on held-out data, computed by the live members after a committed step
    (runtime/trainer/evaluation.py)."""
    every: int = 0
    """Evaluate the parameters committed after every this many steps (after step s where (s + 1) % every
    == 0); 0: never. In every layout (one-rank, FSDP2, TP, pipeline stages), not with
    parallel.on_rank_loss=replan."""
    microbatches: int = 4
    """Evaluation microbatches (data.batch_size sequences each), the same ones at every evaluation, shared
    out over the live members; a lost member's share is computed by the others."""
    path: str = ""
    """Held-out token files or a text file, as data.path reads them; empty: eval.split of the training
    data."""
    split: float = 0.0
    """With eval.path empty: this fraction of the training data (the tail of a text corpus, the last
    windows of token files) is held out for evaluation and never read by training; 0: none."""


@dataclass(frozen=True)
class OptimConfig:
    """The AdamW optimizer, its learning-rate schedule, parameter groups and gradient clipping."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "constant"
    """The learning rate after warmup, as a pure function of the committed step (model/optim.py): cosine
    or linear down to min_lr_ratio x lr at the last step, constant, or warmup-stable-decay (constant,
    then linear down over the last decay_steps steps)."""
    warmup_steps: int = 0
    """Steps of linear warmup: step s (from 0) runs at lr x (s + 1) / warmup_steps."""
    decay_steps: int = 0
    """wsd: the final steps over which the lr decays linearly to min_lr_ratio x lr."""
    min_lr_ratio: float = 0.0
    """The lr the schedule decays to, as a fraction of lr (cosine, linear, wsd)."""
    max_grad_norm: float = 0.0
    """Clip the committed, reduced gradient to this global 2-norm before the optimizer step (summed
    over a group's FSDP2 and TP shards and pipeline stages, tied weights once); 0: no clipping. The
    step record carries the norm before clipping (grad_norm)."""
    decay_norms_and_biases: bool = False
    """Weight-decay parameters of fewer than 2 dimensions (norms' scales, biases) too."""
    decay_embeddings: bool = False
    """Weight-decay embedding tables (and a head tied to one) too."""


@dataclass(frozen=True)
class CoordConfig:
    """Heartbeats, timeouts and where the coordination state lives."""
    heartbeat_interval: float = 0.25
    """Seconds between a member's heartbeats and the coordinator's liveness rounds."""
    heartbeat_timeout: float = 3.0
    """Seconds without a heartbeat before a member is declared dead."""
    startup_timeout: float = 120.0
    """Seconds a member may take from its first heartbeat to its first step."""
    progress_timeout: float = 20.0
    """Seconds in one compute microbatch before a beating member is declared stuck."""
    collective_timeout: float = 30.0
    """Seconds before gloo gives up on a collective by itself."""
    run_timeout: float = 900.0
    """Seconds before the launcher gives up on the whole run."""
    store: str = ""
    """Where coordination state lives: empty, the coordinator's own TCPStore (one host); or an etcd
    cluster, etcd://h1:2379,h2:2379,h3:2379[/namespace] (needs unbroken[etcd];
    docs/etcd.md)."""
    standbys: int = 1
    """With an etcd store: coordinators beside the leader, each ready to take over."""
    lease_ttl: int = 5
    """Whole seconds: with etcd, a leader silent this long is replaced by a standby."""


@dataclass(frozen=True)
class RunConfig:
    """The training run: its replicas, steps, microbatches, seed and arithmetic, and how it recovers and
    commits."""
    replicas: int = 4
    """Data-parallel replica groups (one process each, or parallel.group_size)."""
    steps: int = 20
    """Optimizer steps to commit."""
    microbatches: int = 8
    """Microbatches per step, constant whatever fails."""
    seed: int = 0
    """Seed of the model's initialization, the data order and dropout."""
    exact: bool = False
    """Float64 accumulation and reduction: bitwise the failure-free trajectory."""
    threads: int = 1
    """Torch threads per replica, identical on all (exact mode needs that)."""
    quotas: Literal["speed", "equal", "drop"] = "speed"
    """What a slow group's quota becomes: "speed", the detector's speed estimates weight the quotas;
    "equal", never; "drop", a group declared Slow is parked for the rest of the run (no microbatches;
    ResiHP's drop baseline)."""
    recovery: Literal["live", "restart-memory", "restart-disk"] = "live"
    """How the run recovers from a lost replica: "live" goes on without it; "restart-memory" restarts
    the job from in-memory snapshots (needs snapshot.enabled); "restart-disk" from the latest checkpoint
    (needs checkpoint.every) (policy/recovery.py)."""
    step_ahead: Literal["auto", "on", "off"] = "auto"
    """Commit pipelining: the optimizer steps and the next step computes before the commit decision is
    read, undone on retry (runtime/trainer/speculation.py). "auto": states up to 8 MiB in host memory
    (64 MiB on an accelerator), and not with snapshots or checkpoints; "on": any size; "off": never."""


@dataclass(frozen=True)
class FaultsConfig:
    """Faults injected into the run, to test that it survives them (docs/faults.md)."""
    spec: str = ""
    """Faults to inject, e.g. 'kill:replica=1,step=10,phase=allreduce; hang:replica=2,step=14,for=8'
    (the grammar: docs/faults.md)."""


@dataclass(frozen=True)
class LaunchConfig:
    """How the local launcher starts the run's processes: the run directory, the live view, how processes
    start, how often a group or the whole job restarts, and core pinning."""
    out: str = "runs/latest"
    """Run directory: events.jsonl, summary.json, logs."""
    progress: bool = True
    """Live progress with rich."""
    launcher: Literal["fork", "direct", "torchrun"] = "fork"
    """How the local launcher starts its processes: "torchrun" runs the cluster's own command (one
    torchrun job per group, docs/cluster.md); "direct" spawns the worker itself, which saves
    torchrun's agent process per group; "fork" forks the coordinator, the snapshot agents and one-rank
    groups' trainers from a process that imported torch once (launcher/zygote.py), and a group of several
    ranks is a forked torchrun agent whose ranks fork from it (runtime/trainer/forkrun.py): about 3 CPU-s
    less per trainer start and restart."""
    restarts: int = 0
    """Torchrun's --max-restarts for each group: a group restarted after a failure rejoins the running
    job, healed from a live group (the local launcher's torchrun; on a cluster, the user's torchrun
    line)."""
    max_job_restarts: int = 20
    """run.recovery=restart-*: whole-job restarts (new generations) after which the launcher gives up."""
    pin_cores: bool = False
    """The local launcher pins replica group r's processes to its own cores (group r's G ranks share
    cores r*G .. r*G+G-1, modulo the cores this process may use), as a GPU a rank gives each its own
    device: a survivor then cannot speed up on a dead peer's core, and a waiting peer lends none to a slow
    one."""


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots of the training state, held by one agent process per node."""
    enabled: bool = False
    """In-memory snapshots held by one agent process per node."""
    every: int = 1
    """Committed steps between snapshots."""
    nodes: int = 1
    """Emulated nodes (failure domains), one snapshot agent each; divides run.replicas."""
    parity: Literal["none", "xor", "rs"] = "none"
    """Parity across nodes: "none", "xor" (k+1) or "rs" (k+m Reed-Solomon, pyeclib)."""
    k: int = 0
    """Data shards per parity stripe; snapshot.nodes must be a multiple of k+m."""
    m: int = 0
    """Parity shards per stripe."""
    shm_dir: str = "/dev/shm/unbroken"
    """Directory of the agents' shared-memory segments."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints on disk (torch.distributed.checkpoint)."""
    every: int = 0
    """Committed steps between DCP checkpoints, the last step saved too (what `unbroken export` reads); 0:
    none."""
    dir: str = ""
    """Checkpoint directory; empty: RUN_DIR/checkpoints."""


@dataclass(frozen=True)
class ParallelConfig:
    """Parallelism inside a replica group (FSDP2, pipeline and tensor parallelism) and what a group does
    when it loses a rank."""
    group_size: int = 1
    """Ranks per replica group: one torchrun job of this many processes per group, the model sharded over
    them with FSDP2 (HSDP: the replicate dimension across groups is the fault-tolerant one)."""
    pp: int = 1
    """Pipeline stages inside a group (the GPT's blocks split over them); group_size = pp x tp x FSDP
    shards."""
    tp: int = 1
    """Tensor-parallel degree inside a group (attention heads and MLP units split)."""
    mixed_precision: Literal["bf16", "off"] = "off"
    """"bf16": compute in bfloat16 (FSDP2's param dtype inside a group of shards, reducing in float32;
    autocast around the forward elsewhere), with float32 master weights, optimizer state and gradient
    accumulator (float64 under --exact). Runs on the CPU too. Pipeline stages send their activations in bf16
    (not with parallel.on_rank_loss=replan)."""
    on_rank_loss: Literal["drop", "replan"] = "drop"
    """What a group that loses a rank does: "drop" (the whole group leaves until torchrun brings it back)
    or "replan" (the scheduler of policy/replan_scheduler.py chooses; "shrink" runs the group on its
    survivors, healed from a peer group). replan starts one torchrun agent per rank, as a group spanning
    hosts."""
    replace_after: float = -1.0
    """Local launcher, on_rank_loss=replan: seconds after a rank's torchrun agent ended before a
    replacement agent starts for it (a spare host arriving: the group re-forms at its full plan); < 0:
    never."""
    claim_wait: float = 3.0
    """on_rank_loss=replan: seconds the first survivor of a broken group waits for the others to claim
    their places before it asks the coordinator for a plan."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each rank computes: "auto" (CUDA where its process sees a GPU, else CPU), "cpu" or "cuda".
    On a GPU a group's ranks talk over NCCL (gloo for the step protocol's CPU tensors); the cross-group
    fault-tolerant all-reduce on NCCL or gloo as parallel.cross_backend says. Runs on one GPU; NCCL
    inside a group (2 GPUs or more) not yet."""
    cross_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """The cross-group fault-tolerant all-reduce's backend: "auto" (NCCL where the rank computes on CUDA,
    gloo on CPU), "nccl" (CUDA ranks only: refused at config time without CUDA) or "gloo" (CUDA tensors
    staged through host memory). The NCCL path (runtime/parallel/nccl.py) has not run on a GPU yet."""
    bucket_mb: float = 25.0
    """Size of a bucket of the cross-group all-reduce, MB (DDP's bucket_cap_mb), in groups of one rank on
    gloo: each bucket is copied and its all-reduce issued as the backward of the replica's last
    microbatch makes its gradients final, overlapping the rest of that backward (runtime/trainer/
    reduction.py). Groups of several ranks and NCCL reduce each shard's buffer whole."""


@dataclass(frozen=True)
class MetricsConfig:
    """The coordinator's Prometheus, TensorBoard and Weights & Biases outputs."""
    port: int = 0
    """The coordinator serves Prometheus /metrics on this port; 0: off (needs unbroken[metrics])."""
    host: str = "127.0.0.1"
    """Address /metrics listens on; 0.0.0.0 lets a Prometheus elsewhere scrape it."""
    tensorboard: str = ""
    """Directory for TensorBoard event files, written by the coordinator; empty: off."""
    wandb: str = ""
    """A Weights & Biases project the coordinator logs to what TensorBoard gets (loss, lr, grad_norm,
    throughput, live replicas, recoveries, faults), one W&B run per unbroken run, its id the run's, which
    `unbroken resume` continues; empty: off (needs unbroken[wandb]; WANDB_MODE=offline writes RUN_DIR/wandb/
    only)."""


@dataclass(frozen=True)
class DetectorSection:
    """The fail-slow detector's thresholds (policy/detection.py's DetectorConfig and Predictor; the
    coordinator's slowness.py and replan.py). A step's score is log(observed / predicted time) minus the
    fleet's; the CUSUM adds each step's score less the allowance."""
    drift_ratio: float = 1.08
    """CUSUM allowance as a slowdown ratio: slowdowns under it never accumulate evidence."""
    suspect_at: float = 0.15
    """CUSUM level (log units) for Suspect: one 1.2x step reaches it."""
    slow_at: float = 0.45
    """CUSUM level (log units) for Slow: 1.3x sustained gets there in 3 steps, 1.6x and more in 2."""
    max_increment: float = 0.3
    """Evidence (log units) one step may add: one bad step alone is at most Suspect."""
    recover_below_ratio: float = 1.08
    """A Slow replica's step counts as calm under this slowdown ratio."""
    recover_steps: int = 3
    """Calm steps in a row that make a Slow replica Healthy again."""
    regime_move_ratio: float = 1.15
    """A replica "moved" when its raw score is beyond this ratio either way."""
    regime_quorum: float = 0.5
    """More than this share of a device class moving the same way is a regime change (the predictor is
    rescaled; nobody is flagged)."""
    min_fleet: int = 3
    """Replicas of a device class needed to normalize by the fleet median (fewer: by the fastest)."""
    speed_window: int = 8
    """Recent steps whose median gives a Slow replica's speed estimate."""
    min_speed: float = 0.1
    """Lowest speed reported, so a slow replica keeps some work and can show recovery."""
    warmup_steps: int = 6
    """The run's first steps (and a joining member's): they add evidence above warmup_drift_ratio only."""
    warmup_drift_ratio: float = 1.3
    """CUSUM allowance during warm-up, as a slowdown ratio (start-up inflates healthy replicas' time)."""
    join_skip: int = 1
    """A member joining a running fleet: its first steps neither scored nor taught to the predictor."""
    design_noise: float = 0.05
    """Noise of the step score (log-sd) the fixed thresholds above are set for: they are the floors of
    the adaptive ones (policy/noise.py), and in force until a noise is measured."""
    noise_window: int = 64
    """A replica's recent Healthy steps whose scores give its measured noise (a robust, MAD-based sd)."""
    noise_cap: float = 2.0
    """A replica's own noise counts at most this many times its fleet's (and at least the fleet's)."""
    drift_sigmas: float = 1.0
    """CUSUM allowance at measured noise s: the larger of drift_ratio's and this many s."""
    suspect_sigmas: float = 2.0
    """Suspect level at noise s: the larger of suspect_at and this many s."""
    slow_sigmas: float = 7.0
    """Slow level at noise s: the larger of slow_at and this many s (max_increment grows in proportion)."""
    recover_sigmas: float = 1.0
    """Calm-step bound at noise s: the larger of recover_below_ratio's and this many s."""
    predictor_window: int = 256
    """Microbatch timings per device class the time predictor fits over."""
    refit_every: int = 64
    """New timings between the predictor's refits."""
    min_samples: int = 12
    """Timings the predictor needs before its first fit (at least 3, at most predictor_window)."""
    replay_steps: int = 64
    """Committed steps a taking-over coordinator (etcd standby) replays into its detector."""
    locate_steps: int = 4
    """Committed steps whose per-rank times locate a Slow group's slow rank (of those since the group
    left Healthy)."""


@dataclass(frozen=True)
class DetectSection:
    """Silent data corruption: replicas that must hold the same state, compared (docs/corruption.md)."""
    state_every: int = 8
    """Compare every replica group's parameters and optimizer state (a digest per shard index) after
    every this many committed steps; a group that differs from the majority is healed from a peer in
    place. 0: never."""
    evict_after: int = 2
    """A device (a group's rank) found with corrupted state this many times is evicted: its group leaves
    the run as a lost one does, instead of being healed again. 0: never evicted."""
    recompute_fraction: float = 0.0
    """Share of each step's microbatches (a pure draw of the step) whose gradient two more replicas
    compute and compare with the owner's before the step is reduced; an owner outvoted leaves the step
    and its microbatches are recomputed. One-rank replica groups; bitwise only under --exact. 0: off."""
    finite_check: bool = True
    """Check each group's own gradient sum and loss for NaN and inf before it is reduced; a group whose
    sum is not finite leaves the step (its microbatches are recomputed by the others) and the run."""


@dataclass(frozen=True)
class HardwareSection:
    """The re-plan cost model's hardware figures (policy/stepcost.py's Hardware): stated for H100 hosts,
    not measured on this machine."""
    tp_bytes_per_s: float = 150e9
    """Per-GPU bus bandwidth of a TP all-reduce inside a host, bytes/s (NVLink 4, a third of its 450 GB/s
    per direction, as small all-reduces achieve)."""
    pp_bytes_per_s: float = 25e9
    """One GPU's share of the inter-host fabric, bytes/s (a 200 Gb/s NIC per GPU)."""
    peer_bytes_per_s: float = 25e9
    """A rank pulling state from a peer group's rank, bytes/s, over the same NIC."""
    state_budget_bytes: float = 60e9
    """Bytes per GPU for parameters, gradients and optimizer state (80 GB HBM less room for activations)."""
    reform_seconds: float = 2.0
    """One-off seconds to re-form a group's and the cross-group process groups after a plan change (a
    shrink on CPU gloo re-forms in about 0.1-0.5 s)."""
