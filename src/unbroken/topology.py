"""The arithmetic of replica groups x ranks x nodes, and who this process is in it.

Owns: `Topology` (how many replica groups, ranks per group, ranks per node; which node a rank lives on;
global rank numbers), checked when built the way torchtitan's `ParallelDims` checks its degrees, and
`Identity`, the frozen "who am I" of one trainer process (its replica group, its rank in the group, the
group's size, its node), read once from the environment. Pure: plain ints, the standard library only,
so the runtime, the snapshot layout and the simulator share one arithmetic. Does not own: building
process groups (runtime/parallel/) or choosing sizes (config, policy/scheduling).

Layout: replica groups are laid out contiguously. Global rank = group * group_size + rank; node =
global rank // ranks_per_node, so a group of G ranks on nodes of G ranks is one host, as torchrun per
host gives. Rank j of every group holds the same shard and reduces with the others over shard index j.
Inside a group, G = pp x dp_shard x tp, TP innermost (torchtitan's mesh order): rank =
(stage * dp_shard + shard) * tp + tp_index, so a TP team is consecutive ranks on one host.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class TopologyError(ValueError):
    """A topology that does not add up; the message names the offending numbers."""


@dataclass(frozen=True)
class Topology:
    groups: int  # replica groups (the data-parallel, fault-tolerant dimension)
    group_size: int = 1  # ranks per replica group (sharded inside: FSDP2 / TP / PP)
    ranks_per_node: int = 1  # trainer ranks per host (failure domain), the last node may hold fewer
    tp: int = 1  # tensor-parallel degree inside a group
    pp: int = 1  # pipeline stages inside a group; the rest of the group (dp_shard) shards with FSDP

    def __post_init__(self) -> None:
        for name in ("groups", "group_size", "ranks_per_node", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"{name}={value!r}: must be a whole number >= 1")
        if self.group_size % (self.tp * self.pp):
            raise TopologyError(f"group_size={self.group_size} is not a multiple of tp={self.tp} x pp={self.pp}")

    @staticmethod
    def of_nodes(groups: int, group_size: int, nodes: int, pp: int = 1, tp: int = 1) -> Topology:
        """The topology of `groups` x `group_size` ranks spread evenly over `nodes` hosts; raises
        TopologyError unless the nodes divide the ranks."""
        world = groups * group_size
        if nodes < 1 or world % nodes:
            raise TopologyError(f"nodes={nodes} does not divide {groups} groups x {group_size} ranks = {world}")
        return Topology(groups, group_size, world // nodes, tp=tp, pp=pp)

    @property
    def world(self) -> int:
        """Trainer ranks in all."""
        return self.groups * self.group_size

    @property
    def nodes(self) -> int:
        return -(-self.world // self.ranks_per_node)

    @property
    def shards(self) -> int:
        """Shard indices: one cross-group collective group each."""
        return self.group_size

    @property
    def dp_shard(self) -> int:
        """FSDP degree inside a group: group_size == pp * dp_shard * tp."""
        return self.group_size // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, FSDP shard, TP index) of `rank` inside its group."""
        self._check(0, rank)
        return rank // (self.dp_shard * self.tp), rank // self.tp % self.dp_shard, rank % self.tp

    def global_rank(self, group: int, rank: int = 0) -> int:
        self._check(group, rank)
        return group * self.group_size + rank

    def group_of(self, global_rank: int) -> int:
        return global_rank // self.group_size

    def node_of(self, group: int, rank: int = 0) -> int:
        return self.global_rank(group, rank) // self.ranks_per_node

    def node_ranks(self, node: int) -> range:
        """The global ranks on `node`."""
        return range(node * self.ranks_per_node, min((node + 1) * self.ranks_per_node, self.world))

    def _check(self, group: int, rank: int) -> None:
        if not 0 <= group < self.groups:
            raise TopologyError(f"group {group} out of range: {self.groups} groups")
        if not 0 <= rank < self.group_size:
            raise TopologyError(f"rank {rank} out of range: groups of {self.group_size}")


@dataclass(frozen=True)
class Identity:
    """Who this trainer process is: built once at start-up (`from_env`) and passed down."""
    group: int  # replica group id
    rank: int  # rank inside the group
    group_size: int
    node: int

    @staticmethod
    def from_env(env: Mapping[str, str], topology: Topology) -> Identity:
        """Read UNBROKEN_REPLICA (the group; the launcher or the user's torchrun line sets it) and torchrun's
        RANK (the rank inside the group's torchrun job; absent: 0). Raises TopologyError for a group or
        rank the topology does not have, or a torchrun WORLD_SIZE that is not its group size."""
        try:
            group = int(env["UNBROKEN_REPLICA"])
            rank = int(env.get("RANK", "0"))
            world = int(env.get("WORLD_SIZE", str(topology.group_size)))
        except (KeyError, ValueError) as e:
            raise TopologyError(f"bad trainer environment: {e}") from None
        if world != topology.group_size:
            raise TopologyError(f"WORLD_SIZE={world} but replica groups have {topology.group_size} ranks")
        return Identity(group, rank, topology.group_size, topology.node_of(group, rank))
