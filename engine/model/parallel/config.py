"""What a worker rank needs to join its tensor-parallel group (plain data, no torch), and where
the ranks of a DP x TP topology live when it spans several hosts."""

from __future__ import annotations

import dataclasses

import msgspec


class TensorParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    rank: int  # within the replica's group: 0 samples and answers the scheduler
    size: int
    # Rendezvous (torch.distributed's TCP store, served by rank 0). Port 0: rank 0 binds a free
    # port when it (re)starts and tells the other ranks of its host over the rendezvous ring.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Ranks > 0 that cannot read the plan ring (another host) get each step's plan from rank 0
    # over the group instead; set for every rank of a group that spans hosts.
    relay_plans: bool = False
    local_rank: int = 0  # index among the ranks on this host (which GPU a CUDA rank takes)
    timeout_s: float = 300.0  # rendezvous: how long rank 0 waits for the others
    # How long a collective waits for a rank that does not join before failing (the group then
    # restarts); bounded so that a hung or out-of-step rank cannot hang its group for good.
    collective_timeout_s: float = 300.0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which ranks run on which host.

    Each replica's TP group is split evenly over the hosts, rank 0 on the head (node 0), so every
    scheduler and rank 0 sit next to the gateway and the plan ring; node k runs tp ranks
    [k * tp / nnodes, (k + 1) * tp / nnodes) of every replica.
    """

    tensor_parallel_size: int
    data_parallel_size: int
    nnodes: int = 1
    node_rank: int = 0

    def validate(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if nodes < 1:
            raise ValueError(f"parallel.nnodes must be >= 1, got {nodes}")
        if not 0 <= self.node_rank < nodes:
            raise ValueError(
                f"parallel.node_rank {self.node_rank} is out of range for nnodes {nodes}: "
                f"expected 0..{nodes - 1}"
            )
        if tp % nodes:
            raise ValueError(
                f"parallel.tensor_parallel_size {tp} is not divisible by parallel.nnodes {nodes}: "
                "each host runs the same number of ranks of every replica"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def ranks_on(self, node: int) -> range:
        """TP ranks (of every replica) hosted on `node`."""
        per_node = self.ranks_per_node
        return range(node * per_node, (node + 1) * per_node)

    @property
    def local_ranks(self) -> int:
        """Worker processes on one host, all replicas together (they share its cores)."""
        return self.ranks_per_node * self.data_parallel_size
