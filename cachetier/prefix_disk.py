"""The prefix cache's disk tier: one file per cached part, written atomically, checked on every read.

A part is either the classical entries of one page (`seg`) or a state snapshot at a page boundary
(`state`), held as a partial `KVLayout` and stored as its packed bytes (`cachetier.layout.pack_layout`).
A file is

    MAGIC | header length (u32, little endian) | header (JSON) | payload | SHA-256 of everything before

The header names the node (digest of the token path), its parent, the page's tokens and the packing
table, so the cache's index can be rebuilt from the directory alone after a restart. Files are written
to a temporary name and renamed into place, so a reader never sees half a file; a file whose checksum
does not match is reported as `CorruptPart` (the cache drops it: a miss, never a crash).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from cachetier.layout import KVLayout, PackedLayout, pack_layout, unpack_layout

MAGIC = b"HSPFX001"
_LEN = struct.Struct("<I")
_SUM = 32  # sha256 digest bytes
SEG, STATE = "seg", "state"
KINDS = (SEG, STATE)


class CorruptPart(Exception):
    """A part's file is unreadable, truncated or fails its checksum."""


@dataclass(frozen=True)
class DiskRecord:
    """What a file's header says (read at start-up to rebuild the index)."""

    digest: str
    kind: str
    parent: str | None
    tokens: tuple[int, ...]
    """The page's tokens (`seg` files); empty for `state` files."""
    file_bytes: int


class DiskTier:
    """Files of cached parts in one directory. Knows nothing of budgets or LRU (the cache decides)."""

    def __init__(self, directory: str, fmt: str) -> None:
        self.directory = directory
        self.format = fmt
        os.makedirs(directory, exist_ok=True)

    def path(self, digest: str, kind: str) -> str:
        return os.path.join(self.directory, f"{digest}.{kind}")

    def write(self, digest: str, kind: str, parent: str | None, tokens: tuple[int, ...], part: KVLayout) -> int:
        """Store `part` atomically; returns the file's size in bytes."""
        packed = pack_layout(part, self.format)
        header = json.dumps({
            "format": self.format, "kind": kind, "digest": digest, "parent": parent, "tokens": list(tokens),
            "num_tokens": packed.num_tokens, "table": packed.table, "kinds": packed.kinds,
            "tensor_bytes": packed.tensor_bytes,
        }).encode()
        payload = np.ascontiguousarray(packed.buffer).tobytes()
        body = MAGIC + _LEN.pack(len(header)) + header + payload
        final = self.path(digest, kind)
        tmp = os.path.join(self.directory, f".tmp-{digest}.{kind}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(body)
            f.write(hashlib.sha256(body).digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return len(body) + _SUM

    def read(self, digest: str, kind: str) -> KVLayout:
        """The part stored under (digest, kind), its tensors owning their memory; `CorruptPart` if it is bad."""
        try:
            with open(self.path(digest, kind), "rb") as f:
                raw = f.read()
        except OSError as e:
            raise CorruptPart(f"cannot read {digest}.{kind}: {e}") from None
        if len(raw) < len(MAGIC) + _LEN.size + _SUM or raw[: len(MAGIC)] != MAGIC:
            raise CorruptPart(f"{digest}.{kind} is not a prefix-cache file")
        body, checksum = raw[:-_SUM], raw[-_SUM:]
        if hashlib.sha256(body).digest() != checksum:
            raise CorruptPart(f"{digest}.{kind} fails its checksum")
        header, start = _header(body)
        if header.get("format") != self.format or header.get("digest") != digest or header.get("kind") != kind:
            raise CorruptPart(f"{digest}.{kind} belongs to another model or name")
        payload = bytearray(body[start:])  # writable, owned: the unpacked tensors view it
        try:
            packed = PackedLayout(header["num_tokens"], header["format"],
                                  tuple((i, p, d, tuple(s), o) for i, p, d, s, o in header["table"]),
                                  tuple(header["kinds"]), np.frombuffer(payload, dtype=np.uint8), header["tensor_bytes"])
            return unpack_layout(packed)
        except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as e:  # a file of another version
            raise CorruptPart(f"{digest}.{kind} cannot be unpacked: {type(e).__name__}: {e}") from None

    def remove(self, digest: str, kind: str) -> None:
        try:
            os.remove(self.path(digest, kind))
        except FileNotFoundError:
            pass

    def scan(self) -> list[DiskRecord]:
        """Headers of every readable file of this model's format; leftovers of interrupted writes and files of
        another format are removed (their checksum is checked when they are read)."""
        out = []
        for name in sorted(os.listdir(self.directory)):
            full = os.path.join(self.directory, name)
            if name.startswith(".tmp-"):
                os.remove(full)
                continue
            digest, _, kind = name.partition(".")
            if kind not in KINDS:
                continue
            try:
                with open(full, "rb") as f:
                    head = f.read(len(MAGIC) + _LEN.size)
                    if head[: len(MAGIC)] != MAGIC:
                        raise ValueError("bad magic")
                    (n,) = _LEN.unpack(head[len(MAGIC):])
                    header = json.loads(f.read(n))
                if header["format"] != self.format or header["digest"] != digest or header["kind"] != kind:
                    raise ValueError("another format")
            except (OSError, ValueError, KeyError, struct.error):
                os.remove(full)
                continue
            out.append(DiskRecord(digest, kind, header["parent"], tuple(header["tokens"]), os.path.getsize(full)))
        return out


def _header(body: bytes) -> tuple[dict, int]:
    (n,) = _LEN.unpack(body[len(MAGIC) : len(MAGIC) + _LEN.size])
    start = len(MAGIC) + _LEN.size
    try:
        return json.loads(body[start : start + n]), start + n
    except ValueError as e:
        raise CorruptPart(f"unreadable header: {e}") from None

