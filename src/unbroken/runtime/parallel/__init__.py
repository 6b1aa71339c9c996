"""Collectives and the model as one rank holds it.

Owns: the fault-tolerant cross-replica groups, one per membership epoch and shard index
(collectives.py), and `parallelize` (parallelize.py), the seam through which a worker gets "the model
as this rank holds it". Does not own: membership (control/) or the step protocol (trainer.py).
"""
