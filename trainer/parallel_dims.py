"""`ParallelDims`: the one object that knows the `pp x dp x tp` layout.

Rank order is tp innermost, then dp, then pp (Megatron's order):

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ranks of one TP group are consecutive and, with `ranks_per_node` a
multiple of tp (checked in the config), a TP group never spans nodes. The
`DeviceMesh` is built once; groups are looked up by `Axis`, never kept in
module globals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily so that config checks stay cheap
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


class Axis(str, enum.Enum):
    """Names of process groups. DP/TP/PP are mesh axes; EMBED ties the first and
    last pipeline stage (the tied embedding / LM head); WORLD is everyone."""

    DP = "dp"
    TP = "tp"
    PP = "pp"
    EMBED = "embed"
    WORLD = "world"


MESH_AXES = (Axis.PP, Axis.DP, Axis.TP)  # outermost first


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    sp: bool
    nodes: int
    rank: int
    world_size: int
    _mesh: "DeviceMesh | None" = field(default=None, repr=False)
    _embed_group: "ProcessGroup | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(f"dp*tp*pp={self.dp * self.tp * self.pp} != world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    # -- coordinates -------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def coords(self) -> dict[str, int]:
        return {"dp": self.dp_rank, "tp": self.tp_rank, "pp": self.pp_rank}

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def rank_at(self, *, dp: int | None = None, tp: int | None = None, pp: int | None = None) -> int:
        """Global rank of the coordinate that equals ours except where given."""
        dp = self.dp_rank if dp is None else dp
        tp = self.tp_rank if tp is None else tp
        pp = self.pp_rank if pp is None else pp
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def ranks_in(self, axis: Axis) -> list[int]:
        """Global ranks of this rank's group along `axis`, in group-rank order."""
        if axis is Axis.DP:
            return [self.rank_at(dp=i) for i in range(self.dp)]
        if axis is Axis.TP:
            return [self.rank_at(tp=i) for i in range(self.tp)]
        if axis is Axis.PP:
            return [self.rank_at(pp=i) for i in range(self.pp)]
        if axis is Axis.EMBED:
            return sorted({self.rank_at(pp=0), self.rank_at(pp=self.pp - 1)})
        return list(range(self.world_size))

    def group_rank(self, axis: Axis) -> int:
        return self.ranks_in(axis).index(self.rank)

    def group_size(self, axis: Axis) -> int:
        return len(self.ranks_in(axis))

    # -- process groups ----------------------------------------------------
    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """Create the mesh (and the embedding groups). Collective: every rank calls it."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            self._mesh = init_device_mesh(
                device_type, (self.pp, self.dp, self.tp), mesh_dim_names=tuple(a.value for a in MESH_AXES)
            )
            # new_group is collective over the whole world and must be called in the
            # same order on every rank, also by ranks that are not members.
            if self.pp > 1:
                for dp in range(self.dp):
                    for tp in range(self.tp):
                        members = sorted({self.rank_at(dp=dp, tp=tp, pp=0), self.rank_at(dp=dp, tp=tp, pp=self.pp - 1)})
                        group = dist.new_group(members)
                        if self.rank in members:
                            self._embed_group = group
        return self._mesh

    @property
    def mesh(self) -> "DeviceMesh":
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not been called")
        return self._mesh

    def group(self, axis: Axis) -> "ProcessGroup":
        import torch.distributed as dist

        if axis is Axis.WORLD:
            return dist.group.WORLD
        if axis is Axis.EMBED:
            if self._embed_group is None:
                raise RuntimeError("no embedding group: pp == 1 or this rank is not on the first/last stage")
            return self._embed_group
        return self.mesh[axis.value].get_group()

    @classmethod
    def from_config(cls, parallel, *, rank: int, world_size: int) -> "ParallelDims":
        return cls(
            dp=parallel.dp,
            tp=parallel.tp,
            pp=parallel.pp,
            sp=parallel.sp,
            nodes=parallel.nodes,
            rank=rank,
            world_size=world_size,
        )
