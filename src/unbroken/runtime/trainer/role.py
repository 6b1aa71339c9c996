"""What this rank is in its replica group, for the step loop: one frozen value, derived once.

Owns: `RankRole`, the arithmetic of a rank's part in each step (which shard indices it reduces, digests
and heals; whose rows of each microbatch it computes; whether it counts the loss; how many of its group's
ranks time their work and publish), from the topology, the rank and what the worker built, in the spirit
of torchtitan's `ParallelDims`: checked and unit-tested apart from the loop that uses it. A plain rank
and a stand-in (a shrunk group's rank holding several shard indices: parallel/standin.py) are two values
of it, not two code paths. Does not own: building what the rank holds (admission.py) or the step.
Pure: the standard library and the topology only.
"""
from __future__ import annotations

from dataclasses import dataclass

from unbroken.topology import Identity, Topology


@dataclass(frozen=True)
class RankRole:
    """One rank's part in every step. Build with `RankRole.of` once per trainer."""
    group: int  # its replica group
    rank: int  # its rank in the group
    ranks: int  # the group's ranks (its plan's: a re-formed group's fewer)
    holds: tuple[int, ...]  # the shard indices it reduces, digests and heals: its own, or a stand-in's
    indices: int  # shard indices per member, each reduced and published once a step: the full plan's G
    timed: int  # the ranks that time their part of each microbatch and publish it (a stand-in alone: 1)
    share: int  # its FSDP2 shard: whose rows of each microbatch it computes (data.part)
    shares: int  # FSDP2 shards per microbatch (the topology's dp_shard)
    computes: tuple[int, ...]  # the shares whose rows it computes: its own; a stand-in for FSDP2 shards, all
    fsdp: bool  # FSDP2 inside its group: its microbatch is its rows, reduce-scattered per batch
    counts_loss: bool  # of a TP team, one rank counts the loss (TP index 0); a stand-in always
    standin: bool  # it stands in for several shard indices of a shrunk group
    shrinkable: bool  # parallel.on_rank_loss=replan may shrink its group around it (a full plan's rank)

    @classmethod
    def of(cls, topology: Topology, who: Identity, grouped: bool, held: tuple[int, ...] | None = None,
           standin_shares: int = 1, replan: bool = False) -> RankRole:
        """The role of `who` under `topology`: `grouped`, its group has a process group of its own (not a
        one-rank stand-in); `held`, the shard indices a stand-in holds (None: a plain rank); its FSDP2
        shares (`StandIn.shares`); `replan`, parallel.on_rank_loss=replan."""
        standin = held is not None
        _, share, tp_index = topology.coords(who.rank)
        shares = topology.dp_shard
        return cls(group=who.group, rank=who.rank, ranks=who.group_size,
                   holds=tuple(held) if standin else (who.rank,), indices=topology.group_size,
                   timed=who.group_size if grouped else 1, share=share, shares=shares,
                   computes=tuple(range(shares)) if standin and standin_shares > 1 else (share,),
                   fsdp=grouped and shares > 1 and not standin, counts_loss=tp_index == 0 or standin,
                   standin=standin, shrinkable=replan and who.group_size > 1 and not standin)

    @property
    def tag(self) -> dict:
        """The fields that name this rank on its own events: its rank in a group of several, and the shard
        indices a stand-in holds."""
        return {**({"rank": self.rank} if self.ranks > 1 else {}),
                **({"shards": list(self.holds)} if self.standin else {})}

    def shard_tag(self, shard: int) -> dict:
        """The tag of an event about one shard index (a stand-in's: that index as its rank)."""
        if not self.standin:
            return self.tag
        return {k: v for k, v in self.tag.items() if k != "shards"} | {"rank": shard}
