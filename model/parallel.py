"""One rank of a replica: its process groups and the collectives the model's layers call.

A replica (`core.parallel.ParallelLayout`) runs one process per device. Per forward pass every rank:
- with expert parallelism, starts with one all_gather of row counts over the metadata (gloo) group,
  so every MoE exchange pads to the same size on every rank (`begin_forward`; a step loop that gathered
  the counts already to decide who idles passes them on through `sync_rows`, and no second gather runs).
  A fixed-shape step gathers nothing: its ranks agreed on the host, before it, that each runs the same
  bucket of rows (`fix_rows`), so every exchange is that many rows from every rank. Nothing of the step
  then needs the host, and on CUDA the whole step, exchanges included, is one CUDA graph (NCCL
  collectives are capturable; `decode.runner` captures the same buckets in the same order on every rank);
- per attention layer with attention-TP: one all_reduce (sum) of the output projection over its TP group;
- per MoE layer with expert parallelism: one all_gather of (rows, expert ids, routing weights), padded to
  the largest rank's rows, the local experts on all gathered rows, and one reduce_scatter (sum) that hands
  every rank the routed output of its own rows. Routing happens before the exchange (on the rank's own
  tokens), so hash-routed layers need no token ids from other ranks.

Every rank enters every collective in the same order: a rank with no rows runs `V4Model.idle_forward`
(or, in a fixed-shape step, the bucket's forward over padding rows only).
Counters of calls and bytes per kind make the cost per step visible (`stats`; a replayed graph adds what
its capture recorded, since a replay runs no Python).
"""

from __future__ import annotations

import datetime
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from core.config import ModelConfig
from core.parallel import ParallelLayout, Shard
from kernels.formats import FP8_BLOCK

# torch 2.13 names the single-tensor collectives `*_single` (the `*_tensor` spellings warn); older ones lack them
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

META = "meta_all_gather"
TP_ALL_REDUCE = "tp_all_reduce"
EP_ALL_GATHER = "ep_all_gather"
EP_REDUCE_SCATTER = "ep_reduce_scatter"
TP_BROADCAST = "tp_broadcast"


class ReplicaBroken(RuntimeError):
    """A step failed on a rank of an expert-parallel replica: the replica's collectives no longer line up,
    so the rank cannot go on (its actor exits and the replica is rebuilt; its requests are prefilled again)."""


@dataclass
class CollectiveStats:
    """Collective calls and the bytes this rank put in, by kind, since the last `reset`."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + t.numel() * t.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def copy(self) -> CollectiveStats:
        return CollectiveStats(dict(self.calls), dict(self.bytes))

    def since(self, before: CollectiveStats) -> CollectiveStats:
        """What was added after `before` (a copy taken earlier)."""
        return CollectiveStats({k: v - before.calls.get(k, 0) for k, v in self.calls.items() if v != before.calls.get(k, 0)},
                               {k: v - before.bytes.get(k, 0) for k, v in self.bytes.items() if v != before.bytes.get(k, 0)})

    def restore(self, before: CollectiveStats) -> None:
        """Back to `before`: what a graph capture recorded was not sent (the replays send it)."""
        self.calls, self.bytes = dict(before.calls), dict(before.bytes)

    def merge(self, other: CollectiveStats) -> None:
        for k, v in other.calls.items():
            self.calls[k] = self.calls.get(k, 0) + v
        for k, v in other.bytes.items():
            self.bytes[k] = self.bytes.get(k, 0) + v

    def to_dict(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Comm:
    """The collectives of one rank. Build it with `Comm.open` (joins the process group) or directly from
    groups that exist already; hand it to `V4Model.attach`."""

    def __init__(self, layout: ParallelLayout, rank: int, device: torch.device, tp_group=None, meta_group=None,
                 ep_group=None, tp_meta_group=None) -> None:
        self.layout, self.rank, self.device = layout, rank, torch.device(device)
        self.shard: Shard = layout.shard(rank)
        self.tp, self.ep = layout.tp, layout.ep
        self.tp_group, self.meta_group, self.ep_group = tp_group, meta_group, ep_group
        self.tp_meta_group = tp_meta_group if tp_meta_group is not None else tp_group
        self.tp_leader = rank - self.shard.tp_rank  # the global rank of this TP group's leader
        self.stats = CollectiveStats()
        self._counts: list[int] | None = None  # row counts of the forward under way
        self._pending: list[int] | None = None  # gathered by sync_rows for the next forward

    @classmethod
    def open(cls, layout: ParallelLayout, rank: int, address: str, device: torch.device | str = "cpu",
             timeout_s: float = 300.0) -> Comm:
        """Join the replica's process group at `address` (`tcp://host:port`, opened by whichever rank gets
        there first) and build the TP and metadata groups. nccl on CUDA, gloo otherwise; metadata always
        travels over gloo."""
        device = torch.device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=layout.world, timeout=timeout)
        # every rank creates every group, in the same order
        tp_group = tp_meta_group = None
        for ranks in layout.tp_groups():
            g = dist.new_group(ranks, backend=backend) if layout.tp > 1 else None
            gm = dist.new_group(ranks, backend="gloo", timeout=timeout) if layout.tp > 1 and backend != "gloo" else g
            if rank in ranks:
                tp_group, tp_meta_group = g, gm
        meta_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        return cls(layout, rank, device, tp_group=tp_group, meta_group=meta_group, ep_group=dist.group.WORLD,
                   tp_meta_group=tp_meta_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------- per step

    def gather(self, value: int) -> list[int]:
        """Every rank's `value` (one gloo all_gather of one integer)."""
        return [row[0] for row in self.gather_ints([value])]

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values`, one list per rank (one gloo all_gather; every rank sends as many)."""
        mine = torch.tensor(list(values), dtype=torch.long)
        out = torch.empty(self.layout.world * mine.numel(), dtype=torch.long)
        _all_gather(out, mine, group=self.meta_group)
        self.stats.add(META, mine)
        return out.view(self.layout.world, -1).tolist()

    def tp_broadcast(self, obj=None):
        """The TP group leader's `obj` on every rank of the group (pickled, over gloo): how a leader hands its
        followers what they need to run the same step."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.tp_leader, group=self.tp_meta_group)
        self.stats.calls[TP_BROADCAST] = self.stats.calls.get(TP_BROADCAST, 0) + 1
        return box[0]

    def rounds(self, forwards: int) -> int:
        """The most forwards any rank runs this step, given this rank's: a step loop in lockstep runs idle
        forwards for the difference (0: nobody has work, nobody runs one)."""
        return max(self.gather(forwards))

    def sync_rows(self, rows: int) -> list[int]:
        """All ranks' row counts for the coming forward; the next `begin_forward` uses them instead of
        gathering again. A step loop calls this on every rank to decide who idles."""
        self._pending = self.gather(rows)
        return self._pending

    def fix_rows(self, rows: int) -> None:
        """The coming forward is a fixed-shape step in which every rank of the replica runs `rows` rows (the
        bucket its step loop agreed on with the others, padding rows included): its MoE exchanges are `rows`
        rows from each rank, with no row counts gathered inside it."""
        self._pending = [rows] * self.layout.world

    def begin_forward(self, rows: int) -> None:
        """Called by the model at the start of each forward with this rank's rows."""
        if self.ep == 1:
            return
        counts, self._pending = self._pending, None
        if counts is None:
            self.sync_rows(rows)
            counts, self._pending = self._pending, None
        if counts[self.rank] != rows:
            raise RuntimeError(f"rank {self.rank} announced {counts[self.rank]} rows for this step but runs {rows}")
        self._counts = counts

    # ------------------------------------------------------------------------------------- layers

    def tp_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel projection's partial outputs over the TP group (in place)."""
        self._all_reduce(partial, self.tp_group)
        self.stats.add(TP_ALL_REDUCE, partial)
        return partial

    def routed_experts(self, experts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's rows x [n, hidden] with their routing (expert ids, weights [n, top_k]) -> the routed
        experts' output [n, hidden], every expert running on the rank that holds it."""
        counts = self._counts
        if counts is None:
            raise RuntimeError("routed_experts outside a forward: the model calls begin_forward first")
        most = max(counts)
        n, hidden = x.shape
        if most == 0:
            return x.new_zeros(n, hidden)
        k = idx.shape[1]
        # one buffer for the three tensors, fp32 (expert ids are small integers, exact in fp32)
        send = torch.zeros(most, hidden + 2 * k, dtype=torch.float32, device=x.device)
        send[:n, :hidden] = x
        send[:n, hidden:hidden + k] = idx
        send[:n, hidden + k:] = weights
        gathered = torch.empty(self.ep * most, hidden + 2 * k, dtype=torch.float32, device=x.device)
        self._all_gather(gathered, send, self.ep_group)
        self.stats.add(EP_ALL_GATHER, send)
        y = experts(gathered[:, :hidden].to(x.dtype), gathered[:, hidden:hidden + k].long(),
                    gathered[:, hidden + k:].to(weights.dtype))  # [ranks * most, hidden], zero for padding rows
        out = torch.empty(most, hidden, dtype=y.dtype, device=y.device)
        self._reduce_scatter(out, y.contiguous(), self.ep_group)
        self.stats.add(EP_REDUCE_SCATTER, y)
        return out[:n].to(x.dtype)

    # the device collectives of a step, as methods: a stand-in communicator (tests) replaces them with tensor ops
    # of the same shapes
    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, group) -> None:
        _all_gather(out, inp, group=group)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group) -> None:
        _reduce_scatter(out, inp, group=group)

    def _all_reduce(self, t: torch.Tensor, group) -> None:
        dist.all_reduce(t, group=group)

    def all_equal(self, value: int) -> bool:
        """Whether every rank of the replica holds the same integer (a digest check: top-k picks, LRU state)."""
        t = torch.tensor([value, -value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.meta_group)
        return int(t[0]) == value and int(-t[1]) == value


# --------------------------------------------------------------------------------------------- shards

_BLOCK = r"^(?:layers\.\d+|mtp)\."  # a main layer's names, or the MTP block's (split like a layer's)
_BY_HEADS = re.compile(_BLOCK + r"attn\.(wq_b\.weight|attn_sink)$")
_BY_GROUP_ROWS = re.compile(_BLOCK + r"attn\.wo_a\.weight$")
_BY_GROUP_COLS = re.compile(_BLOCK + r"attn\.wo_b\.weight$")
_EXPERT_STACK = re.compile(_BLOCK + r"ffn\.experts\.(gate_up|down)(_scale)?$")


def shard_slice(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the tensor `name` (this project's spelling; a packed linear's `.scale` goes by its
    `.weight`) that `shard` keeps, counted in the dense weight's elements; None: the rank keeps all of it.

    The one place that says what a rank holds: the loader reads these slices from the checkpoint, tests
    cut whole models with them, and `model.layers` builds modules of the matching shapes."""
    if shard.tp > 1:
        if _BY_HEADS.match(name):
            first, n = shard.heads(cfg)
            unit = 1 if name.endswith("attn_sink") else cfg.head_dim
            return 0, first * unit, (first + n) * unit
        if _BY_GROUP_ROWS.match(name) or _BY_GROUP_COLS.match(name):
            first, n = shard.groups(cfg)
            dim = 0 if _BY_GROUP_ROWS.match(name) else 1
            return dim, first * cfg.o_lora_rank, (first + n) * cfg.o_lora_rank
    if shard.ep > 1 and _EXPERT_STACK.match(name):
        first, n = shard.experts(cfg)
        return 0, first, first + n
    return None


def _tile_range(name: str, lo: int, hi: int, tiles: int) -> tuple[int, int]:
    """A slice of an FP8 weight in elements -> the slice of its per-128 tile scales; the cut must fall on tiles."""
    end = -(-hi // FP8_BLOCK)
    if lo % FP8_BLOCK or (hi % FP8_BLOCK and end != tiles):
        raise ValueError(
            f"this split cuts {name} inside a {FP8_BLOCK}-wide FP8 tile (elements {lo}..{hi}); load it with "
            f"weights='dequantize' or choose a parallel degree whose slices are multiples of {FP8_BLOCK}"
        )
    return lo // FP8_BLOCK, end


def take_shard(name: str, t, cfg: ModelConfig, shard: Shard):
    """This rank's part of tensor `name` (a torch tensor, or a safetensors slice read lazily); `t` itself when
    the rank keeps all of it."""
    is_scale = name.endswith(".scale") and not _EXPERT_STACK.match(name)
    rule = shard_slice(name[: -len(".scale")] + ".weight" if is_scale else name, cfg, shard)
    if rule is None:
        return t
    dim, lo, hi = rule
    if is_scale:
        shape = t.get_shape() if not isinstance(t, torch.Tensor) else t.shape
        lo, hi = _tile_range(name, lo, hi, shape[dim])
    index = (slice(None),) * dim + (slice(lo, hi),)
    out = t[index]
    return out.contiguous() if isinstance(out, torch.Tensor) else out


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """Cut a whole model's state dict (our names) down to `shard`'s tensors."""
    return {k: take_shard(k, v, cfg, shard).clone() for k, v in state.items()}
