"""The data-parallel side of a learner group: who this rank is, its share of a step, and the few collectives.

Every rank of a group runs the same `Learner` code on the same batch (SPMD): screening, staleness and
bookkeeping (step, versions, EMA, counters) come out identical everywhere, so only what differs is
exchanged. A step's records are split over the ranks by tokens (`split_by_tokens`); each rank forwards
and back-propagates its share with the loss normalised by the WHOLE batch's completion tokens and
multiplied by the number of ranks, because DeepSpeed averages the gradients over the ranks: the sum of
the shares' gradients is then exactly the one-rank gradient of the token-mean loss.

`Collective` is the one place that talks torch.distributed for the learner's own messages (a version
number, a flag, sums, the checkpoint's optimiser partitions); with one rank every call is local, so the
one-rank learner behaves exactly as before groups existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RankSpec:
    """This process's place in a learner group: its rank, the group's size, and where the group meets."""

    rank: int
    world_size: int
    init_method: str  # rank 0's `tcp://<ip>:<port>` (or a `file://` rendezvous for a lone rank)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")


def split_by_tokens(costs: Sequence[int], keys: Sequence[object], ranks: int) -> list[list[int]]:
    """Indices of `costs` for each rank, balanced by total cost; units with the same key stay together.

    Records sharing a key (their prompt) are one unit, so a rank forwards a shared prompt once (prefix
    sharing works within a rank's micro-batches). When there are fewer units than ranks, units are
    split into single records so every rank gets work. Deterministic: units by cost, largest first
    (ties by first index), each to the rank with the least so far (ties: the lowest rank). Each
    rank's indices are returned sorted.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(costs) != len(keys):
        raise ValueError(f"{len(costs)} costs for {len(keys)} keys")
    units: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        units.setdefault(key, []).append(i)
    groups = list(units.values())
    if len(groups) < ranks:
        groups = [[i] for i in range(len(costs))]
    order = sorted(groups, key=lambda g: (-sum(costs[i] for i in g), g[0]))
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for unit in order:
        r = min(range(ranks), key=lambda k: (loads[k], k))
        shares[r].extend(unit)
        loads[r] += sum(costs[i] for i in unit)
    return [sorted(s) for s in shares]


class Collective:
    """The learner's own messages between the ranks of its group (no-ops for a lone rank)."""

    def __init__(self, spec: RankSpec | None) -> None:
        self.rank = spec.rank if spec is not None else 0
        self.world_size = spec.world_size if spec is not None else 1

    @property
    def grouped(self) -> bool:
        return self.world_size > 1

    @property
    def writer(self) -> bool:
        """Rank 0 writes everything the group shares: versions, checkpoints, metrics, quarantine."""
        return self.rank == 0

    def _device(self) -> Any:
        import torch

        backend = torch.distributed.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank."""
        if not self.grouped:
            return value
        import torch

        t = torch.tensor([value], dtype=torch.long, device=self._device())
        torch.distributed.broadcast(t, src=0)
        return int(t.item())

    def rank0_writes(
        self,
        write: Callable[[], T],
        outcome: Callable[[T], int],
        what: str,
        errors: tuple[type[Exception], ...] = (OSError,),
    ) -> tuple[T | None, int]:
        """Rank 0 runs `write`; every rank learns its `outcome` (a number >= 0), or fails alike.

        Returns rank 0's result (None on the other ranks) and the outcome on every rank. When the write
        raises one of `errors`, rank 0 raises it and the other ranks an `OSError` saying that rank 0 could
        not `what`; alone, the error is raised as it is. Every rank must call this at the same point.
        """
        result, error = None, None
        if self.writer:
            try:
                result = write()
            except errors as err:
                if not self.grouped:
                    raise
                error = err
        number = self.broadcast_int(outcome(result) if result is not None else -1)
        if number < 0:
            raise error or OSError(f"rank 0 could not {what}")
        return result, number

    def max_int(self, value: int) -> int:
        if not self.grouped:
            return value
        import torch

        t = torch.tensor([value], dtype=torch.long, device=self._device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        if not self.grouped:
            return list(values)
        import torch

        t = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(t)
        return [float(v) for v in t.tolist()]

    def union(self, indices: set[int], size: int) -> set[int]:
        """The union over the ranks of sets of indices below `size`."""
        if not self.grouped:
            return set(indices)
        import torch

        t = torch.zeros(size, dtype=torch.long, device=self._device())
        for i in indices:
            t[i] = 1
        torch.distributed.all_reduce(t)
        return {i for i, v in enumerate(t.tolist()) if v}

    def gather_plain(self, value: Any) -> list[Any] | None:
        """Every rank's `value` (plain data: numbers, strings, lists, dicts, CPU tensors) on rank 0, None elsewhere.

        Sent as `state_bytes` (JSON + safetensors in a uint8 tensor), never pickled: rank 0 listens on a
        TCP rendezvous, and whatever could join the group must not be able to make it run code.
        """
        if not self.grouped:
            return [value]
        import torch

        padded, sizes = self._payload(value)
        out = [torch.empty_like(padded) for _ in sizes] if self.writer else None
        torch.distributed.gather(padded, out, dst=0)
        if out is None:
            return None
        return [self._decode(t, n, r) for r, (t, n) in enumerate(zip(out, sizes, strict=True))]

    def all_plain(self, value: Any) -> list[Any]:
        """Every rank's `value` (small plain data) on every rank, encoded as `gather_plain`'s."""
        if not self.grouped:
            return [value]
        import torch

        padded, sizes = self._payload(value)
        out = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(out, padded)
        return [self._decode(t, n, r) for r, (t, n) in enumerate(zip(out, sizes, strict=True))]

    def _payload(self, value: Any) -> tuple[Any, list[int]]:
        """`value` encoded, padded to the longest rank's encoding, and every rank's length (a collective)."""
        import torch

        from diprl.learn.state_files import state_bytes

        data = bytearray(state_bytes(value))
        payload = torch.frombuffer(data, dtype=torch.uint8).to(self._device())
        lengths = torch.zeros(self.world_size, dtype=torch.long, device=payload.device)
        lengths[self.rank] = payload.numel()
        torch.distributed.all_reduce(lengths)
        sizes = [int(n) for n in lengths.tolist()]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=payload.device)
        padded[: payload.numel()] = payload
        return padded, sizes

    @staticmethod
    def _decode(tensor: Any, size: int, rank: int) -> Any:
        from diprl.learn.state_files import state_from_bytes

        return state_from_bytes(tensor[:size].cpu().numpy().tobytes(), where=f"learner rank {rank}'s message")


def rendezvous_store(spec: RankSpec) -> Any | None:
    """The group's TCP store for a `tcp://host:port` init method (None for any other kind).

    torch's own `tcp://` rendezvous has rank 0's store listen on every interface whatever host it names, so
    a group meeting at `tcp://127.0.0.1:P` could be joined, and its store written, from the network. Rank 0
    binds the socket itself, on the named host only, and hands it to the store; the others connect to it.
    """
    import socket
    from urllib.parse import urlsplit

    import torch.distributed as dist

    address = urlsplit(spec.init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        return None
    timeout = dist.constants.default_pg_timeout
    if spec.rank != 0:
        return dist.TCPStore(address.hostname, address.port, spec.world_size, False, timeout)
    family = socket.getaddrinfo(address.hostname, address.port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address.hostname, address.port))
    listener.listen()
    return dist.TCPStore(
        address.hostname, address.port, spec.world_size, True, timeout, master_listen_fd=listener.detach()
    )
