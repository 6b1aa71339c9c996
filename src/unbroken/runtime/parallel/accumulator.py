"""The local gradient accumulator of one replica, and the parameter digest.

Owns: one flat buffer holding the sum of this replica's weighted microbatch gradients for the current
step (float64 in exact mode, float32 otherwise) with one extra trailing element for the weighted loss, so
the loss is reduced with exactly the same exactly-once semantics as the gradient; writing a reduced buffer
back into `.grad`; the digests of the parameters. Does not own: reduction (collectives.py).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn as nn
import xxhash
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: the local shard of a DTensor (FSDP2 inside a replica
    group), else `t` itself. Not differentiable: for reading and writing data, never inside autograd."""
    # The DTensor's own local tensor (what `to_local()` returns, the same storage), without to_local's
    # autograd Function (~7 us a call) or a DTensor `detach` before it (~10 us, a dispatch). Measured on
    # the default GPT's 28 FSDP2-sharded parameters: a digest took 0.71 ms (xxh3) and 0.97 ms (sha256)
    # through them, 0.05 and 0.33 ms without, a rank of a 2 x 2 HSDP run takes one or both a step.
    return t._local_tensor if isinstance(t, DTensor) else t


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters in `named_parameters` order, tied weights once: the fixed order of every flat view."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


class Accumulator:
    """Call `zero()` once at the start of a step, `add(loss)` after each microbatch's backward.

    The buffer is never cleared inside a step: after a failed reduction it still holds this replica's
    whole partial sum, so a retry only adds the microbatches it newly owns. Shape: (numel + 1,).
    """

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, hooked: bool = False):
        self.params = params
        # hooked: gradients reach `add_shard`, and `.grad` is dropped in `add`: a sharded group's
        # reduce-scatter output in the reduce dtype (parallelize.reduced_shards; `.grad` is FSDP2's float32
        # copy of it), or a pipeline stage's per-microbatch gradients (pipeline.Stages)
        self.hooked = hooked
        self._slot = {id(p): i for i, p in enumerate(params)}
        self.sizes = [local(p).numel() for p in params]  # this rank's shard of each (all of it in DP)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]  # each one's start in `buffer`
        # on the parameters' device: gradients are added in place, and a step's reduction reads it there
        self._buffer = torch.zeros(sum(self.sizes) + 1, dtype=dtype, device=local(params[0]).device if params else None)
        # When the buffer has the parameters' dtype (float32 mode), each `.grad` *is* a view of it, as
        # DDP's gradient_as_bucket_view: backward accumulates in place (AccumulateGrad adds into a
        # defined grad: 0 + g1 + g2 ..., the same float32 sums as copying), so nothing is copied.
        # Sharded parameters (DTensors) get a DTensor `.grad`, built from the local slice in `load_grads`.
        self.sharded = any(local(p) is not p for p in params)
        self.views = all(p.dtype == dtype for p in params) and not self.sharded and not hooked
        self.uniform = bool(params) and all(p.dtype == params[0].dtype for p in params)  # one flat grad fits all
        # Views are made once and kept: slicing and reshaping 28 parameters' views cost ~60 us a step
        # (at every zero() and every load_grads), setting `.grad` to a kept view ~4 us for all 28.
        self._own = self._split(self._buffer) if self.views else []
        # Otherwise `add` folds the gradients into these slices in one foreach call: slicing, reshaping and
        # adding 28 parameters one by one took ~90 us a call, ~33 us so (FSDP2 shards, thread time)
        self._slices = self._split(self._buffer) if not self.views and not hooked else []
        # --exact on the CPU (float64 slices, float32 gradients): a fold is one numpy add, which widens
        # the gradient in cache-sized pieces, where torch's CPU add first widens all of it into a float64
        # temporary (8 bytes a parameter written, read back, its pages faulted in). And the first fold of
        # a slice in a step writes 0.0 + g instead of adding into zeros: `zero` leaves the slices unset
        # (`_unset`), so a step makes one pass over the buffer less, and reads it once less.
        wide = bool(self._slices) and dtype == torch.float64 and self._buffer.device.type == "cpu" \
            and all(local(p).dtype == torch.float32 for p in params)
        self._wide = [s.numpy() for s in self._slices] if wide else []
        self._unset: set[int] = set()  # parameters whose slice `zero` left unwritten (zero once read)
        # Views whose first gradient of a step a hook writes (`fold`), set by a reducer whose hooks fold:
        # `zero` then leaves the views unset and `.grad` None, so backward hands over a fresh gradient
        # and the hook writes 0.0 + g into its view (8 bytes a parameter) instead of a zeroed buffer
        # (4) and an add into it (12); later microbatches add into the view in place, as before.
        self.lazy = False
        self._loaded: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (reduced buffer, grads over it)
        self._grads: list[torch.Tensor] | None = None  # float64 reduced: float32 grads over `_flat`, kept
        self._flat: torch.Tensor | None = None
        self._loss = self._buffer[-1:]  # (1,) view: `buffer[-1] += x` is a select, an add and a copy back

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat (numel + 1,) buffer, shaped like the parameter."""
        views, offset = [], 0
        for p, n in zip(self.params, self.sizes):
            views.append(flat[offset:offset + n].view_as(local(p)))
            offset += n
        return views

    @property
    def buffer(self) -> torch.Tensor:
        """The flat (numel + 1,) sum of the step so far: what a reduction copies. Reading it zeroes what
        `zero` left unset, so it reads as a buffer cleared at the step's start."""
        if self._unset:
            slices = self._own if self.views else self._slices
            for i in self._unset:
                slices[i].zero_()
            self._unset = set()
        return self._buffer

    def zero(self) -> None:
        """Clear the buffer; call once at the start of a step, never inside one."""
        if self._wide or (self.lazy and self.views):
            self._loss.zero_()
            self._unset = set(range(len(self.params)))
        else:
            self._buffer.zero_()
        self.attach()

    def attach(self) -> None:
        """Point each `.grad` at its slice of the buffer again (float32 mode), keeping what it holds:
        after anything set `.grad` elsewhere (`load_grads`, `zero_grad`) within a step that goes on.
        A `lazy` view not yet written this step gets None: its first gradient is the hook's to write."""
        for i, (p, view) in enumerate(zip(self.params, self._own)):
            p.grad = None if i in self._unset else view

    def add(self, weighted_loss: torch.Tensor | None, share: int = 0) -> None:
        """Fold one microbatch in after its backward: its gradients (unless backward already wrote them
        into the buffer's views, or its hooks folded them: `fold`) and its weighted loss (None:
        `add_loss` took it before the backward). `share` (whose FSDP2 rows) matters only to a stand-in's
        accumulator (standin.ShardedAccumulator): this one holds one rank's own."""
        if self.hooked:
            for p in self.params:
                p.grad = None
        elif self._wide:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._fold(i, local(p.grad))
                    p.grad = None
        elif self.lazy and self.views:
            for i in range(len(self.params)):  # what no hook wrote (none fires without its reducer)
                self._fold_view(i)
        elif not self.views:
            # float32 grads added into float64 slices are exact: every float32 is a float64
            pairs = [(s, local(p.grad)) for s, p in zip(self._slices, self.params) if p.grad is not None]
            if pairs:
                torch._foreach_add_([s for s, _ in pairs], [g for _, g in pairs])
            for p in self.params:
                p.grad = None
        if weighted_loss is not None:
            self.add_loss(weighted_loss)

    def add_loss(self, weighted_loss: torch.Tensor) -> None:
        """Add a microbatch's weighted loss (once per microbatch: in `add`, or before its backward)."""
        # add_ computes in the buffer's dtype: a float32 loss is widened exactly, as `.to(float64)` did
        self._loss.add_(weighted_loss.detach())

    def fold(self, i: int) -> None:
        """Parameter i's gradient of the current backward is final: add it into its slice now and drop
        it (the same add `add` makes: one float32 gradient into float32 or float64, element by element),
        so its slice is final and the gradient's memory free for the next one backward makes. Call from
        its post-accumulate-grad hook. Nothing to do where `.grad` is a view of the buffer. Not for
        `hooked`."""
        if self.views:
            if self.lazy:
                self._fold_view(i)
            return
        p = self.params[i]
        if p.grad is not None:
            self._fold(i, local(p.grad))
            p.grad = None

    def _fold_view(self, i: int) -> None:
        """A `lazy` view's gradient handed over by backward (not added into the view): into the view
        (0.0 + g at the step's first, the bits of an add into a zeroed view, -0.0 -> 0.0), and `.grad`
        pointed at the view for backward to add into in place from then on."""
        p, view = self.params[i], self._own[i]
        grad = p.grad
        if grad is None or grad.data_ptr() == view.data_ptr():
            return
        if i in self._unset:
            self._unset.discard(i)
            torch.add(grad, 0.0, out=view)
        else:
            view.add_(grad)
        p.grad = view

    def _fold(self, i: int, grad: torch.Tensor) -> None:
        """Add one gradient into parameter i's slice: slice + g in the slice's dtype, element by element."""
        if not self._wide or grad.dtype != torch.float32 or grad.layout != torch.strided or grad.requires_grad:
            if i in self._unset:
                self._unset.discard(i)
                self._slices[i].zero_()
            self._slices[i].add_(grad)
            return
        # quiet, as torch's add: inf + -inf makes a NaN without a warning (~1 us a call)
        with np.errstate(all="ignore"):
            if i in self._unset:  # the slice is unset: g + 0.0, as the add into a zeroed one gives (-0.0
                self._unset.discard(i)  # -> 0.0), in float32 (exact there) and widened as it is written
                np.add(grad.numpy(), np.float32(0.0), out=self._wide[i])
            else:
                np.add(self._wide[i], grad.numpy(), out=self._wide[i])

    def add_shard(self, param: torch.Tensor, shard: torch.Tensor) -> None:
        """Add `param`'s shard of a group's reduce-scatter output (float64 in exact mode) into its slice."""
        i = self._slot[id(param)]
        # a tensor-parallel stage's gradient is a DTensor: this rank's slice of it (pipeline.Stages' sink)
        self._buffer[self.offsets[i]:self.offsets[i] + self.sizes[i]].add_(local(shard).reshape(-1))

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers a step reduces, one per shard index held: this rank's own."""
        return [self.buffer]

    def load_reduced(self, reduced: list[torch.Tensor]) -> float:
        """`load_grads` of the reduced copies of `buffers`, in order; the step's loss. A one-rank group's
        bucketed --exact reduction gives two: the float32 gradient, then the float64 loss (1,)."""
        return self.load_grads(reduced[0], reduced[1] if len(reduced) > 1 else None)

    def load_grads(self, reduced: torch.Tensor, loss: torch.Tensor | None = None) -> float:
        """Point `.grad` at a reduced buffer (a float32 copy of it in exact mode; a float32 one itself
        where the reduction rounded it already, its loss in `loss`); returns the reduced (step) loss.
        The gradients over the last buffer given are kept: the all-reduce reuses one."""
        if self.views or (self.uniform and reduced.dtype == self.params[0].dtype):
            # `.grad` is the reduced copy itself: views of it, DTensors over them where sharded (FSDP2,
            # TP). Building 28 DTensors cost ~2 ms, so they are rebuilt only for another buffer (after
            # a failed reduction); a float32 copy of the buffer would hold numel x 4 bytes more.
            if self._loaded is None or self._loaded[0] is not reduced:
                grads = [self._as_grad(p, view) for p, view in zip(self.params, self._split(reduced))]
                self._loaded = (reduced, grads)
            for p, grad in zip(self.params, self._loaded[1]):
                p.grad = grad
        elif self.sharded or (reduced.dtype != self.params[0].dtype and self.uniform):
            # One copy (float64 -> float32 under --exact: the same rounding as each `.to`) into kept
            # gradients: a fresh float32 tensor per parameter a step page-faults its memory in again
            # (numel x 4 bytes a step).
            if self._grads is None:
                self._flat = torch.empty(self._buffer.numel(), dtype=self.params[0].dtype, device=self._buffer.device)
                self._grads = [self._as_grad(p, view) for p, view in zip(self.params, self._split(self._flat))]
            self._flat.copy_(reduced)
            for p, g in zip(self.params, self._grads):
                p.grad = g
        else:
            for p, view in zip(self.params, self._split(reduced)):
                p.grad = view.to(p.dtype)
        return float(reduced[-1] if loss is None else loss[0])

    @staticmethod
    def _as_grad(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """`shard` (this rank's slice, shaped like its local parameter) as `p`'s gradient: a DTensor of
        p's mesh, placements and global shape (shards may be uneven: torch.chunk sizes)."""
        if local(p) is p:  # a whole parameter beside sharded ones (tensor parallelism: norms, embeddings)
            return shard
        return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())


# id(tensor) -> (a weak reference to it, its data pointer, its numpy view): see _chunks
_VIEWS: dict[int, tuple[weakref.ref, int, np.ndarray]] = {}


def _chunks(params: list[nn.Parameter]):
    """Each parameter's float32 bytes, in the fixed order of `unique_parameters`, without a copy.
    (A float32 contiguous parameter is hashed as it is: the `.to().contiguous()` no-ops and the cast
    cost ~3 us of dispatch each, ~0.1 ms a digest for 28 parameters, more than xxh3 takes to hash them.
    Its numpy view is made once and kept while the tensor lives on the same memory: a `detach` and a
    `numpy` a parameter each digest took 47 us for the default GPT's 28 FSDP2 shards, 15 us so.)"""
    for p in params:
        t = local(p)
        kept = _VIEWS.get(id(t))
        if kept is not None and kept[0]() is t and kept[1] == t.data_ptr() and kept[2].size == t.numel():
            yield kept[2]  # the optimizer steps in place: the view reads today's values
            continue
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            yield t.detach().to("cpu", torch.float32).contiguous().numpy()  # a GPU's: from a host copy
            continue
        view = t.detach().numpy()  # C-contiguous: the hashes read its buffer as bytes
        key = id(t)  # the entry goes with the tensor (before its id can be reused)
        _VIEWS[key] = (weakref.ref(t, lambda _, key=key: _VIEWS.pop(key, None)), t.data_ptr(), view)
        yield view


def param_digest(params: list[nn.Parameter]) -> str:
    """XXH3-128 (hex) of all float32 parameters, concatenated in the fixed order of `unique_parameters`:
    the step record's digest (of a shard, in a group), each member's `applied` one, a heal's and a
    restore's check. Not sha256: that hashes ~2 GB/s on one core, 3.2 ms a step for a 6.5 MB shard
    where XXH3 takes 0.16 ms. Errors it guards against are bit flips and wrong state, not an adversary."""
    h = xxhash.xxh3_128()
    for chunk in _chunks(params):
        h.update(chunk)
    return h.hexdigest()
