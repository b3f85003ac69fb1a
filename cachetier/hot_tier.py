"""The HiSparse tier's hot-buffer state, and its one owner.

With the tier on, a request's C4 entries live in the host pool (authoritative) and each CSA layer of each
request has a hot buffer of `hot_slots` device slots (`lru` LRU-managed, then `reserved` ring slots that
hold the newest entries). The state that ties entries to slots is here, and only here:
- per CSA layer, the *entry map*: for every C4 entry of every map block, the hot slot holding it or -1. A request
  addresses its entries through its map block table: its own pages map as themselves, and a shared page's holders
  after the first through map blocks of their own (`cachetier.sharing`), since each holder's hot buffer holds
  different slots for the same page; a scratch block is last;
- per CSA layer and state group (scratch group last), the map row each hot slot holds and each LRU slot's
  last-use stamp;
- the host pool and its device view (what the step's kernels address: mapped host memory on CUDA);
- the LRU clock and the counters (hits, misses, evictions, host writes per CSA layer), on the device so a
  step never syncs.
The store (admission: `forget`, `place_newest`) and the step view (each step: `layer`, `append`, `tick`)
change it only through the methods below, and `check` holds its invariant: every occupied slot names a live
entry of its request that maps back to it, its vector equals the host copy, and the ring holds exactly the
newest entries. The hot buffers' vectors themselves sit in the device arena, in each state group's `hot`
field (`Geometry.state_fields`).
"""

from __future__ import annotations

import torch

from cachetier.geometry import Geometry, block_rows
from cachetier.host_pool import HostPool
from kernels.host_write import write_rows
from kernels.resolve_ref import EVICTIONS, HITS, MISSES, HotState


class HotTier:
    def __init__(self, geo: Geometry, arena: torch.Tensor, device: torch.device, pin: bool) -> None:
        g = self.geo = geo
        self.arena, self.device = arena, device
        n_csa = len(g.csa_layers)
        self.host = HostPool(n_csa, g.num_host_blocks + 1, g.e4, g.md, g.arena_dtype, pin=pin)  # + the scratch block
        self.host.kv[:, g.num_host_blocks * g.e4 :] = 0
        self.host_scratch_row = g.num_host_blocks * g.e4
        self.host_view = self.host.on(device)
        """The host pool as the step's kernels address it: zero-copy device memory on CUDA (mapped), itself on the CPU."""
        # each its own tensor so a step updates it in place (never through a slice)
        self.entry_map = [torch.full((g.map_blocks * g.e4,), -1, dtype=torch.int32, device=device) for _ in range(n_csa)]
        self.hot_entry_row = [torch.full((g.num_groups + 1, g.hot_slots), -1, dtype=torch.long, device=device)
                              for _ in range(n_csa)]
        self.hot_stamp = [torch.full((g.num_groups + 1, g.lru), -1, dtype=torch.long, device=device) for _ in range(n_csa)]
        self.counters = torch.zeros(max(n_csa, 1), 3, dtype=torch.long, device=device)
        """Hits, misses, evictions per CSA layer."""
        self.host_writes = torch.zeros(max(n_csa, 1), dtype=torch.long, device=device)
        """C4 entries written to the host pool per CSA layer."""
        self.step = torch.zeros((), dtype=torch.long, device=device)
        """The LRU clock: steps run; it stamps hot-buffer use."""
        self.bytes_h2d_admit = 0
        """Bytes copied into hot buffers at admission (the newest entries into the ring)."""

    # views -------------------------------------------------------------------------------------------

    def hot_view(self, j: int) -> torch.Tensor:
        """[groups + 1, hot_slots, row] view of CSA layer j's hot buffers, indexed by state group (scratch last)."""
        g = self.geo
        f = g.state_fields["hot"]
        group_elems = g.group_pages * g.page_elems
        per_group = self.arena[: (g.num_groups + 1) * group_elems].view(g.num_groups + 1, group_elems)
        start = f.offset + j * g.hot_slots * g.md
        return per_group[:, start : start + g.hot_slots * g.md].view(g.num_groups + 1, g.hot_slots, g.md)

    def layer(self, j: int) -> HotState:
        """What resolve reads and updates for CSA layer j."""
        return HotState(self.entry_map[j], self.hot_entry_row[j], self.hot_stamp[j], self.host_view[j], self.step,
                        self.counters[j])

    # admission (the store) -------------------------------------------------------------------------------

    def forget(self, j: int, group: int, map_rows: torch.Tensor) -> None:
        """A request just admitted into state group `group`: none of its entries (their map rows) is resident."""
        self.entry_map[j][map_rows] = -1
        self.hot_entry_row[j][group] = -1
        self.hot_stamp[j][group] = -1

    def unmap(self, j: int, map_rows: torch.Tensor) -> None:
        """Pages a running request just took: none of their entries is resident (whatever an earlier owner left)."""
        self.entry_map[j][map_rows] = -1

    def place_newest(self, j: int, group: int, slots: torch.Tensor, map_rows: torch.Tensor, vectors: torch.Tensor) -> None:
        """The newest entries (their map rows, vectors) into ring `slots` of a request's hot buffer."""
        self.hot_view(j)[group, slots] = vectors
        self.entry_map[j][map_rows] = slots.to(torch.int32)
        self.hot_entry_row[j][group, slots] = map_rows
        self.bytes_h2d_admit += slots.numel() * self.geo.main_bytes

    # the step (the step view) ---------------------------------------------------------------------------

    def append(self, j: int, emit: torch.Tensor, e: torch.Tensor, host_rows: torch.Tensor, groups: torch.Tensor,
               gbase: torch.Tensor, entries: torch.Tensor, map_rows_of, put) -> None:
        """A step's new C4 entry e [rows] of CSA layer j, for the rows that `emit`: its authoritative copy to the
        host pool (host_rows), and into the ring of the hot buffer (the entry leaving the ring is unmapped).
        `map_rows_of(e)` gives entries' map rows; `put(rows, values)` writes arena rows of one vector (the step
        view's single scatter into the arena). Rows that do not emit write to scratch only."""
        g = self.geo
        host_rows = torch.where(emit, host_rows, self.host_scratch_row)
        write_rows(self.host_view, j, host_rows, entries.to(self.host_view.dtype))
        self.host_writes[j : j + 1].add_(emit.sum())
        if not g.reserved:
            return
        entry_map = self.entry_map[j]
        dump = entry_map.shape[0] - 1  # a scratch-page element
        old = e - g.reserved  # the entry leaving the ring
        leaving = emit & (old >= 0)
        entry_map.index_put_((torch.where(leaving, map_rows_of(old.clamp(min=0)), dump),),
                             torch.full_like(e, -1, dtype=entry_map.dtype))
        slot = g.lru + e % g.reserved  # [rows]
        hot = g.state_fields["hot"]
        scratch_gbase = g.scratch_group * g.group_pages * g.page_elems
        put(hot.row(torch.where(emit, gbase, scratch_gbase), j * g.hot_slots) + slot, entries)
        new_rows = map_rows_of(e)
        entry_map.index_put_((torch.where(emit, new_rows, dump),), slot.to(entry_map.dtype))
        self.hot_entry_row[j].index_put_((torch.where(emit, groups, g.scratch_group), slot), new_rows)

    def tick(self) -> None:
        """One step done: the LRU clock advances (on the device)."""
        self.step.add_(1)

    # numbers and the invariant ---------------------------------------------------------------------------

    def totals(self) -> dict:
        c = torch.cat((self.counters.sum(dim=0), self.host_writes.sum()[None])).tolist()  # the one host sync, when asked
        g = self.geo
        return {"hits": c[HITS], "misses": c[MISSES], "evictions": c[EVICTIONS],
                "bytes_h2d": c[MISSES] * g.main_bytes + self.bytes_h2d_admit, "bytes_d2h": c[3] * g.main_bytes}

    def check(self, request_id: str, group: int, maps: torch.Tensor, host_blocks: torch.Tensor, num_entries: int,
              resident: bool = False) -> list[str]:
        """What is wrong with one request's hot buffers (empty: nothing). Reads each layer's bookkeeping to the host
        once (not one sync per slot). `maps`: its entry-map block table. `resident`: its C4 entries are on the device
        in pages of their own, so its hot buffers must hold nothing."""
        g, n = self.geo, num_entries
        e = torch.arange(n, device=self.device)
        rows = block_rows(maps, e, g.e4)
        host_rows = self.host.rows(host_blocks, e.cpu())
        pos = {x: i for i, x in enumerate(rows.tolist())}
        problems = []
        for j in range(len(g.csa_layers)):
            slots = self.entry_map[j][rows].long().tolist() if n else []
            entry_row = self.hot_entry_row[j][group].tolist()
            held = [s for s, row in enumerate(entry_row) if row >= 0]
            for s in held:  # every occupied slot names an entry of this request that maps back to it
                row = entry_row[s]
                if row not in pos:
                    problems.append(f"{request_id} layer {j}: hot slot {s} holds row {row}, not a live entry")
                elif slots[pos[row]] != s:
                    problems.append(f"{request_id} layer {j}: entry map of row {row} is {slots[pos[row]]}, slot says {s}")
            mapped = [i for i, s in enumerate(slots) if s >= 0]
            if len(mapped) != len(held):
                problems.append(f"{request_id} layer {j}: {len(mapped)} entries mapped, {len(held)} slots held")
            if mapped:
                hot = self.hot_view(j)[group, torch.tensor([slots[i] for i in mapped], device=self.device)]
                if not torch.equal(hot.cpu(), self.host.kv[j, host_rows[torch.tensor(mapped)]]):
                    problems.append(f"{request_id} layer {j}: a hot slot differs from its host copy")
            if resident:
                if held or mapped:
                    problems.append(f"{request_id} layer {j}: resident, yet {len(held)} hot slots held, {len(mapped)} mapped")
            elif g.reserved:
                newest = set(range(max(0, n - g.reserved), n))
                ring = {pos.get(entry_row[g.lru + k], -1) for k in range(g.reserved) if entry_row[g.lru + k] >= 0}
                if ring != newest:
                    problems.append(f"{request_id} layer {j}: ring holds {sorted(ring)}, newest are {sorted(newest)}")
        return problems

    def close(self) -> None:
        self.host.close()
