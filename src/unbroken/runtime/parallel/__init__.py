"""Mechanics the trainer runs to hold and reduce a model over many ranks; never a model's module names.

Owns: `parallelize` (parallelize.py), the seam through which a trainer gets "the model as this rank
holds it" (FSDP2, TP, pipeline stages: pipeline.py), the gradient accumulators (accumulator.py), the
fault-tolerant cross-replica groups, one per membership epoch and shard index (collectives.py), the
stand-in that holds a shrunk group's shards (standin.py), devices and sockets. May import: store/, model/
and policy/; never trainer/, coordinator/ or launcher/. Does not own: membership or the step protocol
(trainer/).
"""
