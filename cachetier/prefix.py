"""The prefix cache: what a later prompt needs to resume prefill after a prefix an earlier prompt shared.

A V4 layout has two kinds of KV (see `cachetier.layout`), and they cache differently:
- *classical* (C4 entries, HCA entries, indexer keys) is append-only per position: the entries of tokens
  [a, b) are the same whatever follows, so they are cached once per *page* and shared by every prompt
  through that page;
- *state* (the window ring, compressor tails and CSA overlaps) is valid only at the exact position where it
  was taken, so it is *snapshotted* at chosen page boundaries.

Pages are blocks of the KV block size (`cachetier.geometry.block_tokens_for`): a multiple of both compress
rates, so every page boundary is also a C4 and an HCA window boundary (no entry straddles two pages, the
compressor tails are empty there, only the CSA overlap carries over).

The index is a trie with one node per page, keyed by the page's tokens. A node holds its page's
classical entries (a `seg` part) and, if the state policy kept one, the state at its end (a `state` part).
Resuming at boundary b needs the `seg` parts of every page before b and the `state` part at b; a lookup
takes the deepest node with a state on the longest matching path.

State policy (`PrefixCacheConfig.state_policy`): `last` keeps state at the last page boundary of each
prompt — which is where the next turn of a chat resumes — and at the boundary where a prompt leaves the
cached path (so the next prompt sharing, say, a system prompt resumes at its end); `every` keeps state
at every page. Stats report the state bytes kept beside what `every` would keep.

Tiers: parts live in host memory under a byte budget, least recently used first out; with a disk tier
every part is also written to a file when stored (write-through by a writer thread, so a restart finds the
whole cache), and a host eviction then only frees memory; a part read back from disk on a hit returns to host memory. The disk
tier has its own budget; when a file must go and the part is not in memory, the part is dropped. Dropping
a page drops the pages below it (their entries are useless without it). A lookup pins the nodes of the
matched path (reference counts) until `release`: pinned parts are never evicted.

The disk tier never stops the server (see `cachetier.prefix_disk`): a directory that takes no writes is
still read for hits while new parts stay in memory only, a part whose file could not be written stays in
memory until evicted, and every failure is counted (`disk_read_errors`, `disk_write_errors`).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from cachetier.geometry import block_tokens_for
from cachetier.layout import CompressorState, KVLayout, LayerKV, append_rows
from cachetier.prefix_disk import READ, SEG, STATE, WRITE, CorruptPart, DiskTier
from core.config import ModelConfig
from core.configs import PrefixCacheConfig

log = logging.getLogger(__name__)


class Part:
    """One cached part of a node (`seg`: the page's classical entries; `state`: the state at its end)."""

    __slots__ = ("node", "kind", "value", "nbytes", "file_bytes", "writing", "dropped")

    def __init__(self, node: Node, kind: str, value: KVLayout | None, nbytes: int, file_bytes: int = 0) -> None:
        self.node, self.kind, self.value, self.nbytes, self.file_bytes = node, kind, value, nbytes, file_bytes
        self.writing = False
        """Queued for the disk writer: stays in memory until its file exists."""
        self.dropped = False
        """Dropped while its file was being written: the writer removes the file."""

    @property
    def key(self) -> tuple[str, str]:
        return self.node.digest, self.kind


class Node:
    """One page of a cached token path."""

    __slots__ = ("key", "parent", "children", "digest", "depth", "seg", "state", "refs")

    def __init__(self, key: tuple[int, ...], parent: Node | None, digest: str) -> None:
        self.key, self.parent, self.digest = key, parent, digest
        self.children: dict[tuple[int, ...], Node] = {}
        self.depth = 0 if parent is None else parent.depth + 1
        self.seg: Part | None = None
        self.state: Part | None = None
        self.refs = 0


ROOT = "root"


def page_digest(parent: str, tokens: tuple[int, ...]) -> str:
    """Name of the node after `parent` for the page `tokens` (a hash chain: it names the whole path)."""
    return hashlib.blake2b(parent.encode() + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


def page_keys(tokens, page: int) -> tuple[str, ...]:
    """The chain keys of every full page of `tokens` (pages of `page` tokens), shallowest first: key k names
    tokens[: (k + 1) * page]."""
    out, h = [], ROOT
    for k in range(len(tokens) // page):
        h = page_digest(h, tuple(tokens[k * page : (k + 1) * page]))
        out.append(h)
    return tuple(out)


@dataclass
class PrefixHit:
    """A lookup's answer. `tokens` > 0: resume prefill at that boundary from `segs` + `state`."""

    tokens: int
    """Boundary to resume at (0: nothing usable)."""
    matched_tokens: int
    """Length of the cached path of pages this prompt follows (>= tokens; beyond it no state was kept)."""
    path: list[Node] = field(default_factory=list)
    """Pinned nodes (released by `PrefixCache.release`)."""
    segs: list[KVLayout] = field(default_factory=list)
    state: KVLayout | None = None
    released: bool = False


@dataclass(frozen=True)
class PrefixCacheStats:
    lookups: int
    prompt_tokens: int
    """Tokens of the prompts looked up."""
    hit_tokens: int
    """Tokens served from the cache (resumed past) over those lookups."""
    nodes: int
    """Pages cached (in any tier)."""
    state_snapshots: int
    host_seg_bytes: int
    host_state_bytes: int
    host_pages: int
    disk_seg_bytes: int
    disk_state_bytes: int
    disk_pages: int
    state_snapshot_bytes: int
    """Bytes of one state snapshot (the same for every boundary)."""
    state_bytes_every_page: int
    """State bytes a snapshot at every cached page would hold (the cost `state_policy=last` avoids)."""
    evictions: int
    """Parts moved out of host memory (to disk, or dropped without a disk tier)."""
    disk_drops: int
    """Parts whose file was removed for the disk tier's budget."""
    disk_reads: int
    disk_writes: int
    disk_read_bytes: int
    disk_write_bytes: int
    disk_read_errors: int
    """Files that could not be read or failed their checks (each a miss), and a directory that could not be listed."""
    disk_write_errors: int
    """Files that could not be written or removed, and a directory found at start-up to take no writes."""
    page_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def disk_errors(self) -> int:
        """Every failure of the disk tier."""
        return self.disk_read_errors + self.disk_write_errors

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "disk_errors": self.disk_errors}


class PrefixCache:
    def __init__(self, cfg: ModelConfig, config: PrefixCacheConfig, fmt: str) -> None:
        self.cfg, self.config = cfg, config
        self.page = block_tokens_for(cfg, config.page_tokens)
        self.root = Node((), None, ROOT)
        self.nodes: dict[str, Node] = {}
        self.host_lru: OrderedDict[tuple[str, str], Part] = OrderedDict()
        self.disk_lru: OrderedDict[tuple[str, str], Part] = OrderedDict()
        self.host_bytes = self.disk_bytes = 0
        self.num_states = 0
        self.tally = {(tier, kind): [0, 0] for tier in ("host", "disk") for kind in (SEG, STATE)}
        """(tier, part kind) -> [bytes, parts]: kept as parts move, so stats never walk the cache."""
        self.count = dict.fromkeys(("lookups", "prompt_tokens", "hit_tokens", "evictions", "disk_drops", "disk_reads",
                                    "disk_writes", "disk_read_bytes", "disk_write_bytes"), 0)
        self.state_snapshot_bytes = 0
        self._lock = threading.RLock()
        self.disk = DiskTier(config.directory, fmt) if config.disk_enabled else None
        self._queue: queue.SimpleQueue[Part | None] = queue.SimpleQueue()
        self._idle = threading.Condition(self._lock)
        self._queued = 0
        self._writer: threading.Thread | None = None
        if self.disk is not None:
            self._load_index()
            self._writer = threading.Thread(target=self._write_loop, name="prefix-cache-writer", daemon=True)
            self._writer.start()

    # --- lookup and resume ----------------------------------------------------------------------------

    def acquire(self, tokens, limit: int) -> PrefixHit:
        """Longest cached prefix of `tokens` whose end has a state snapshot and lies at or before `limit`
        (callers pass len - 1: at least one token must run to give logits). Pins the matched path."""
        with self._lock:
            self.count["lookups"] += 1
            self.count["prompt_tokens"] += len(tokens)
            for _ in range(8):  # each retry follows a part that failed to load (and was dropped)
                path = self._walk(tokens)
                r = max((k + 1 for k, n in enumerate(path) if n.state is not None and (k + 1) * self.page <= limit),
                        default=0)
                try:
                    segs = [self._get(n.seg) for n in path[:r]]
                    state = self._get(path[r - 1].state) if r else None
                except CorruptPart as e:  # counted and warned about (once) by the disk tier
                    log.debug("prefix cache: %s; treated as a miss", e)
                    continue
                for n in path:
                    n.refs += 1
                    self._touch(n.seg)
                if r:
                    self._touch(path[r - 1].state)
                self.count["hit_tokens"] += r * self.page
                hit = PrefixHit(r * self.page, len(path) * self.page, path, segs, state)
                self._evict_host()  # parts read back from disk may have taken the host tier over its budget
                return hit
            return PrefixHit(0, 0)

    def release(self, hit: PrefixHit) -> None:
        with self._lock:
            if hit.released:
                return
            hit.released = True
            for n in hit.path:
                n.refs -= 1
            hit.segs, hit.state = [], None
            self._evict_host()

    def restore(self, hit: PrefixHit, layout: KVLayout) -> KVLayout:
        """Fill `layout` (fresh, empty; reserved for the whole prompt) with the hit's entries and state."""
        if not hit.tokens:
            return layout
        for i, lk in enumerate(layout.layers):
            dev = lk.window.device
            for seg in hit.segs:
                s = seg.layers[i]
                if lk.entries is not None:
                    lk.entries = append_rows(lk.entries, s.entries.to(dev, lk.entries.dtype))
                if lk.index_keys is not None:
                    lk.index_keys = append_rows(lk.index_keys, s.index_keys.to(dev, lk.index_keys.dtype))
            st = hit.state.layers[i]
            lk.window.copy_(st.window)
            lk.compressor = _comp_to(st.compressor, dev)
            lk.index_compressor = _comp_to(st.index_compressor, dev)
        layout.num_tokens = hit.tokens
        return layout

    def snapshot_points(self, num_tokens: int, hit: PrefixHit) -> list[int]:
        """Boundaries after the resume point where prefill stops to store a snapshot (the state policy)."""
        p = self.page
        last = num_tokens // p * p
        if self.config.state_policy == "every":
            points = set(range(hit.tokens + p, last + 1, p))
        else:
            points = {last, hit.matched_tokens}
        return sorted(b for b in points if hit.tokens < b <= last)

    # --- storing --------------------------------------------------------------------------------------

    def store(self, tokens, layout: KVLayout, state: bool = True) -> None:
        """Cache the pages of `tokens` (a multiple of the page, = `layout.num_tokens`) not cached yet, and with
        `state` a snapshot of the layout's state at their end. Copies to host memory what it keeps."""
        b = len(tokens)
        if b % self.page or b != layout.num_tokens or b == 0:
            raise ValueError(f"store needs a layout at a page boundary ({self.page}), got {b} tokens / {layout.num_tokens}")
        with self._lock:
            node = self.root
            for k in range(b // self.page):
                key = tuple(tokens[k * self.page : (k + 1) * self.page])
                child = node.children.get(key)
                if child is None:
                    child = Node(key, node, page_digest(node.digest, key))
                    node.children[key] = child
                    self.nodes[child.digest] = child
                    child.seg = self._add(child, SEG, self._segment(layout, k))
                else:
                    self._touch(child.seg)
                node = child
            if state:
                if node.state is None:
                    node.state = self._add(node, STATE, _state_of(layout))
                    self.num_states += 1
                    self.state_snapshot_bytes = node.state.nbytes
                else:
                    self._touch(node.state)
            self._evict_host()

    def _segment(self, layout: KVLayout, k: int) -> KVLayout:
        p, layers = self.page, []
        for i, lk in enumerate(layout.layers):
            rate = self.cfg.compress_rate(i)
            ents = None if lk.entries is None else _host(lk.entries[k * p // rate : (k + 1) * p // rate])
            keys = None
            if lk.index_keys is not None:
                keys = _host(lk.index_keys[k * p // self.cfg.csa_rate : (k + 1) * p // self.cfg.csa_rate])
            layers.append(LayerKV(lk.kind, torch.empty(0, lk.window.shape[1], dtype=lk.window.dtype), ents, keys))
        return KVLayout(p, layers)

    # --- tiers ----------------------------------------------------------------------------------------

    def _add(self, node: Node, kind: str, value: KVLayout) -> Part:
        part = Part(node, kind, None, value.total_bytes())
        self._to_host(part, value)
        if self.disk is not None and self.disk.writable:  # else it lives in memory only, like without a disk tier
            self._enqueue(part)
        return part

    # Files are written by a thread of their own, so the prefill step that stores a part does not wait for
    # its file (a V4 state snapshot is ~8 MB). A part waiting for its file stays in memory (eviction skips
    # it); a part dropped meanwhile has its file removed once written.

    def _enqueue(self, part: Part) -> None:
        part.writing = True
        self._queued += 1
        self._queue.put(part)

    def _write_loop(self) -> None:
        while True:
            part = self._queue.get()
            if part is None:
                return
            node = part.node
            parent = None if node.parent is None or node.parent is self.root else node.parent.digest
            size, value = 0, part.value  # parts never change once stored: read without the lock
            if value is not None and not part.dropped:  # 0: not written (counted by the tier), stays in memory only
                size = self.disk.write(node.digest, part.kind, parent, node.key if part.kind == SEG else (), value)
            with self._lock:
                part.writing = False
                if part.dropped:
                    if size:
                        self.disk.remove(node.digest, part.kind)
                elif size:
                    self._to_disk(part, size)
                    self.count["disk_writes"] += 1
                    self.count["disk_write_bytes"] += size
                    self._trim_disk()
                self._evict_host()  # it may have waited for its file to leave memory
                self._queued -= 1
                self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued file is written (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def close(self) -> None:
        """Finish the queued writes and stop the writer."""
        if self._writer is not None:
            self.flush()
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _get(self, part: Part) -> KVLayout:
        """The part's value, read back from disk into host memory if it is only there."""
        if part.value is not None:
            return part.value
        try:
            value = self.disk.read(part.node.digest, part.kind)
        except CorruptPart:
            self._drop(part)
            raise
        self.count["disk_reads"] += 1
        self.count["disk_read_bytes"] += part.file_bytes
        part.nbytes = value.total_bytes()
        if part.kind == STATE:
            self.state_snapshot_bytes = part.nbytes
        self._to_host(part, value)
        return value

    def _count(self, tier: str, kind: str, nbytes: int, parts: int) -> None:
        """Account `parts` parts of `nbytes` bytes in all entering (positive) or leaving (negative) `tier`."""
        t = self.tally[(tier, kind)]
        t[0] += nbytes
        t[1] += parts
        if tier == "host":
            self.host_bytes += nbytes
        else:
            self.disk_bytes += nbytes

    def _to_host(self, part: Part, value: KVLayout) -> None:
        part.value = value
        self.host_lru[part.key] = part
        self._count("host", part.kind, part.nbytes, 1)

    def _from_host(self, part: Part) -> None:
        del self.host_lru[part.key]
        self._count("host", part.kind, -part.nbytes, -1)
        part.value = None

    def _to_disk(self, part: Part, size: int) -> None:
        part.file_bytes = size
        self.disk_lru[part.key] = part
        self._count("disk", part.kind, size, 1)

    def _from_disk(self, part: Part) -> None:
        del self.disk_lru[part.key]
        self._count("disk", part.kind, -part.file_bytes, -1)
        part.file_bytes = 0

    def _touch(self, part: Part) -> None:
        if part.key in self.host_lru:
            self.host_lru.move_to_end(part.key)
        if part.key in self.disk_lru:
            self.disk_lru.move_to_end(part.key)

    def _evict_host(self) -> None:
        while self.host_bytes > self.config.host_budget:
            part = next((p for p in self.host_lru.values() if p.node.refs == 0 and not p.writing), None)
            if part is None:
                return  # everything left is in use or waiting for its file
            before = len(self.host_lru)
            if part.file_bytes:
                self._from_host(part)
            else:
                self._drop(part)
            self.count["evictions"] += before - len(self.host_lru)

    def _trim_disk(self) -> None:
        while self.disk_bytes > self.config.disk_bytes:
            part = next((p for p in self.disk_lru.values() if p.node.refs == 0), None)
            if part is None:
                return
            before = len(self.disk_lru)
            if part.value is not None:  # still in memory: only the file goes
                self._unfile(part)
            else:
                self._drop(part)
            self.count["disk_drops"] += before - len(self.disk_lru)

    def _unfile(self, part: Part) -> None:
        self.disk.remove(part.node.digest, part.kind)
        self._from_disk(part)

    def _forget(self, part: Part) -> None:
        if part.writing:
            part.dropped = True
        if part.value is not None:
            self._from_host(part)
        if part.file_bytes:
            self._unfile(part)

    def _drop(self, part: Part) -> None:
        """Remove a part from both tiers; a page's entries take the pages below them along."""
        node = part.node
        if part.kind == STATE:
            self._forget(part)
            node.state = None
            self.num_states -= 1
            return
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in order:
            for p in (n.state, n.seg):
                if p is not None:
                    self._forget(p)
            self.num_states -= n.state is not None
            n.state = n.seg = None
            self.nodes.pop(n.digest, None)
        del node.parent.children[node.key]

    def _load_index(self) -> None:
        """Rebuild the trie from the disk tier's files (after a restart); inconsistent files are removed."""
        records = self.disk.scan()
        segs = {r.digest: r for r in records if r.kind == SEG}
        kids: dict[str | None, list] = {}
        for r in segs.values():
            kids.setdefault(r.parent, []).append(r)
        frontier = [(self.root, None)]
        while frontier:
            node, name = frontier.pop()
            for r in kids.pop(name, []):
                if len(r.tokens) != self.page or page_digest(node.digest, r.tokens) != r.digest:
                    continue  # another page size, or a name that does not match its content: removed below
                child = Node(r.tokens, node, r.digest)
                node.children[r.tokens] = child
                self.nodes[r.digest] = child
                child.seg = Part(child, SEG, None, 0)
                frontier.append((child, r.digest))
        for r in records:
            node = self.nodes.get(r.digest)
            if node is None:
                self.disk.remove(r.digest, r.kind)
                continue
            if r.kind == STATE:
                node.state = Part(node, STATE, None, 0)
                self.num_states += 1
            self._to_disk(node.seg if r.kind == SEG else node.state, r.file_bytes)
        self._trim_disk()

    def held_pages(self, limit: int = 100_000) -> list[str]:
        """Names of cached pages, shallowest first (at most `limit`): what routing may send here."""
        with self._lock:
            out, level = [], [self.root]
            while level and len(out) < limit:
                level = [c for n in level for c in n.children.values()]
                out += [n.digest for n in level]
            return out[:limit]

    # --- numbers and checks ---------------------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            t = self.tally
            errors = self.disk.errors if self.disk is not None else {}
            return PrefixCacheStats(
                **{k: self.count[k] for k in ("lookups", "prompt_tokens", "hit_tokens")},
                nodes=len(self.nodes), state_snapshots=self.num_states,
                host_seg_bytes=t[("host", SEG)][0], host_state_bytes=t[("host", STATE)][0], host_pages=t[("host", SEG)][1],
                disk_seg_bytes=t[("disk", SEG)][0], disk_state_bytes=t[("disk", STATE)][0], disk_pages=t[("disk", SEG)][1],
                state_snapshot_bytes=self.state_snapshot_bytes,
                state_bytes_every_page=len(self.nodes) * self.state_snapshot_bytes,
                **{k: self.count[k] for k in ("evictions", "disk_drops", "disk_reads", "disk_writes", "disk_read_bytes",
                                              "disk_write_bytes")},
                disk_read_errors=errors.get(READ, 0), disk_write_errors=errors.get(WRITE, 0),
                page_tokens=self.page,
            )

    def check_integrity(self) -> None:
        """Bookkeeping agrees with itself: tier byte counts, LRU membership, tree links, pins. Raises if not."""
        with self._lock:
            host = disk = seen = states = 0
            stack = [self.root]
            while stack:
                n = stack.pop()
                if n.refs < 0:
                    raise RuntimeError(f"node {n.digest} has {n.refs} references")
                for key, c in n.children.items():
                    if c.parent is not n or c.key != key or self.nodes.get(c.digest) is not c or c.seg is None:
                        raise RuntimeError(f"node {c.digest} is linked inconsistently")
                    if c.refs > n.refs and n is not self.root:
                        raise RuntimeError(f"node {c.digest} is pinned more than its parent")
                    stack.append(c)
                seen += n is not self.root
                states += n.state is not None
                for p in (n.seg, n.state):
                    if p is None:
                        continue
                    if (p.value is not None) != (p.key in self.host_lru) or bool(p.file_bytes) != (p.key in self.disk_lru):
                        raise RuntimeError(f"part {p.key} is in the wrong LRU lists")
                    if p.value is None and not p.file_bytes:
                        raise RuntimeError(f"part {p.key} is in no tier")
                    host += p.nbytes if p.value is not None else 0
                    disk += p.file_bytes
            tally_host = sum(v[0] for (tier, _), v in self.tally.items() if tier == "host")
            tally_disk = sum(v[0] for (tier, _), v in self.tally.items() if tier == "disk")
            if (seen != len(self.nodes) or host != self.host_bytes or disk != self.disk_bytes or tally_host != host
                    or tally_disk != disk or states != self.num_states):
                raise RuntimeError(f"counts disagree: nodes {seen}/{len(self.nodes)}, host {host}/{self.host_bytes}, "
                                   f"disk {disk}/{self.disk_bytes}")
            if len(self.host_lru) + len(self.disk_lru) < len(self.nodes):
                raise RuntimeError("a cached page is in no LRU list")

    def _walk(self, tokens) -> list[Node]:
        path, node, p = [], self.root, self.page
        for k in range(len(tokens) // p):
            node = node.children.get(tuple(tokens[k * p : (k + 1) * p]))
            if node is None:
                break
            path.append(node)
        return path


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _comp_host(c: CompressorState | None) -> CompressorState | None:
    return None if c is None else CompressorState(*(None if t is None else _host(t)
                                                    for t in (c.kv, c.score, c.prev_kv, c.prev_score)))


def _comp_to(c: CompressorState | None, device) -> CompressorState | None:
    return None if c is None else CompressorState(*(None if t is None else t.to(device, copy=True)
                                                    for t in (c.kv, c.score, c.prev_kv, c.prev_score)))


def _state_of(layout: KVLayout) -> KVLayout:
    """A copy of the layout's state (window rings, compressor tails and overlaps) in host memory."""
    layers = [LayerKV(lk.kind, _host(lk.window), compressor=_comp_host(lk.compressor),
                      index_compressor=_comp_host(lk.index_compressor)) for lk in layout.layers]
    return KVLayout(layout.num_tokens, layers)
