"""The prefix cache's disk tier: one file per cached part, written atomically, checked on every read.

A part is either the classical entries of one page (`seg`) or a state snapshot at a page boundary
(`state`), held as a partial `KVLayout` and stored as its packed bytes (`cachetier.layout.pack_layout`).
A file is

    MAGIC | header length (u32, little endian) | header (JSON) | payload | SHA-256 of everything before

The header names the node (digest of the token path), its parent, the page's tokens and the packing
table, so the cache's index can be rebuilt from the directory alone after a restart. Files are written
to a temporary name and renamed into place, so a reader never sees half a file; a file whose checksum
does not match is reported as `CorruptPart` (the cache drops it: a miss, never a crash).

The tier is an optimisation, so the directory's state never stops the server: every disk failure is
counted here (`errors`, by operation) and warned about once per kind, never raised past this class
except as `CorruptPart` from `read`. A directory that does not take writes (read-only, unwritable, not
creatable) is only read from; a write that fails removes its temporary file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
from dataclasses import dataclass

import numpy as np

from cachetier.layout import KVLayout, PackedLayout, pack_layout, unpack_layout

log = logging.getLogger(__name__)

MAGIC = b"HSPFX001"
_LEN = struct.Struct("<I")
_SUM = 32  # sha256 digest bytes
SEG, STATE = "seg", "state"
KINDS = (SEG, STATE)
TMP = ".tmp-"
"""Prefix of files being written (and of the start-up probe): anything so named at start-up is a leftover."""
READ, WRITE = "read", "write"
# A write failing with one of these means the directory takes no writes at all (a read-only mount, lost
# permissions): stop writing rather than fail every later part. A full disk (ENOSPC, EDQUOT) or an I/O
# error may pass, so writes go on being tried (each failure counted).
_NO_WRITES = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


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
        self.errors = {READ: 0, WRITE: 0}
        """Failed operations since start, by kind (read: a file or the directory could not be read or
        failed its checks; write: a file could not be written or removed, or the directory takes no writes)."""
        self._warned: set[tuple[str, object]] = set()
        self._lock = threading.Lock()  # the writer thread and the step thread both count failures
        self.writable = False
        """Whether files are written and removed; False from start-up on a directory that takes no writes,
        or after a write fails in a way that says it never will (`_NO_WRITES`)."""
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            self._fail(WRITE, f"cannot create the directory {directory}", e)
        else:
            self.writable = self._probe()

    def _probe(self) -> bool:
        """Whether a file can be created in the directory (an empty one: a full disk still passes, its
        writes fail one by one). The probe carries the temporary prefix, so a crash here leaves nothing
        a later start does not remove."""
        probe = os.path.join(self.directory, f"{TMP}probe.{os.getpid()}")
        try:
            os.close(_create(probe))
            os.remove(probe)
        except OSError as e:
            self._fail(WRITE, f"{self.directory} takes no writes, so the disk tier only reads what it holds", e)
            _discard(probe)
            return False
        return True

    def _fail(self, op: str, what: str, err: BaseException) -> None:
        """Count one failed operation; warn on the first failure of each kind (not per request)."""
        code = getattr(err, "errno", None)
        with self._lock:
            self.errors[op] += 1
            first = (op, code or type(err).__name__) not in self._warned
            self._warned.add((op, code or type(err).__name__))
            if op == WRITE and code in _NO_WRITES and self.writable:
                self.writable = False
                what += "; no more files are written"
        (log.warning if first else log.debug)("prefix cache disk tier: %s: %s (counted in disk_%s_errors%s)", what, err,
                                              op, "; further failures of this kind are not logged" if first else "")

    def path(self, digest: str, kind: str) -> str:
        return os.path.join(self.directory, f"{digest}.{kind}")

    def write(self, digest: str, kind: str, parent: str | None, tokens: tuple[int, ...], part: KVLayout) -> int:
        """Store `part` atomically; returns the file's size in bytes, or 0 if it was not written (the
        directory takes no writes, or this write failed: counted, its temporary file removed)."""
        if not self.writable:
            return 0
        name = f"{digest}.{kind}"
        tmp = os.path.join(self.directory, f"{TMP}{name}.{os.getpid()}")
        try:
            packed = pack_layout(part, self.format)
            header = json.dumps({
                "format": self.format, "kind": kind, "digest": digest, "parent": parent, "tokens": list(tokens),
                "num_tokens": packed.num_tokens, "table": packed.table, "kinds": packed.kinds,
                "tensor_bytes": packed.tensor_bytes,
            }).encode()
            payload = np.ascontiguousarray(packed.buffer).tobytes()
            body = MAGIC + _LEN.pack(len(header)) + header + payload
            with os.fdopen(_create(tmp), "wb") as f:
                f.write(body)
                f.write(hashlib.sha256(body).digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(digest, kind))
        except Exception as e:  # a full disk, a lost mount, or a part that cannot be packed: the part stays in memory only
            _discard(tmp)
            self._fail(WRITE, f"cannot write {name}", e)
            return 0
        return len(body) + _SUM

    def read(self, digest: str, kind: str) -> KVLayout:
        """The part stored under (digest, kind), its tensors owning their memory; `CorruptPart` (counted) if it
        cannot be read or is bad."""
        try:
            return self._read(digest, kind)
        except CorruptPart as e:
            self._fail(READ, "a cached part is lost (a miss)", e)
            raise

    def _read(self, digest: str, kind: str) -> KVLayout:
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
        self._remove(self.path(digest, kind))

    def _remove(self, path: str) -> None:
        """Remove a file if the directory takes writes (in a read-only one it stays, out of the index)."""
        if not self.writable:
            return
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._fail(WRITE, f"cannot remove {os.path.basename(path)}", e)

    def scan(self) -> list[DiskRecord]:
        """Headers of every readable file of this model's format. Leftovers of interrupted or failed writes and
        files of another format are removed (when the directory takes writes; their checksum is checked when
        they are read); a file or directory that cannot be read is skipped (counted)."""
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as e:
            self._fail(READ, f"cannot list {self.directory}, so the cache starts empty", e)
            return []
        out = []
        for name in names:
            full = os.path.join(self.directory, name)
            if name.startswith(TMP):
                self._remove(full)
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
                    size = os.fstat(f.fileno()).st_size
                if header["format"] != self.format or header["digest"] != digest or header["kind"] != kind:
                    raise ValueError("another format")
                record = DiskRecord(digest, kind, header["parent"], tuple(header["tokens"]), size)
            except OSError as e:  # the file is there but not readable (permissions, I/O): not ours to remove
                self._fail(READ, f"cannot read {name}", e)
                continue
            except (ValueError, KeyError, TypeError, struct.error):  # truncated, another format or version
                self._remove(full)
                continue
            out.append(record)
        return out


def _create(path: str) -> int:
    """A new file opened for writing (every file this tier writes is made here)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _discard(path: str) -> None:
    """Remove a temporary file of a failed operation, if it can be (what cannot is removed at a later start)."""
    try:
        os.remove(path)
    except OSError:
        pass


def _header(body: bytes) -> tuple[dict, int]:
    (n,) = _LEN.unpack(body[len(MAGIC) : len(MAGIC) + _LEN.size])
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(body[start : start + n])
    except ValueError as e:
        raise CorruptPart(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptPart("the header is not a table")
    return header, start + n
