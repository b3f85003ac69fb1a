"""The prefix cache's disk tier under a directory in a bad state: full, read-only, unreadable, not creatable,
holding leftovers or damaged files. In each the cache starts, answers lookups and takes stores without
raising, counts the failures (`disk_read_errors`, `disk_write_errors`) and leaves no temporary files.

Two ways to put a directory in that state: the real one where this process may (a small tmpfs, a read-only
bind mount: needs root and mount rights; chmod: needs a non-root user, since root writes through it), and a
simulated one that always runs (os functions patched to fail with the errno the real case gives, for paths
under the directory only).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import struct
import subprocess

import pytest
import torch

from cachetier.layout import layout_format
from cachetier.prefix import PrefixCache
from cachetier.prefix_disk import MAGIC, TMP
from core.configs import PrefixCacheConfig

PAGE = 64  # the built-in model's files at this page: ~12 KB per page, ~66 KB per state snapshot

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, vocab, (n,), generator=g).tolist()


def _cache(model, directory, host_bytes: int = 1 << 30) -> PrefixCache:
    cfg = PrefixCacheConfig(enabled=True, page_tokens=PAGE, host_bytes=host_bytes, disk_bytes=1 << 30,
                            directory=str(directory))
    return PrefixCache(model.cfg, cfg, layout_format(model.cfg, model.dtype))


def _store(model, cache: PrefixCache, tokens: list[int]) -> None:
    cache.store(tokens, model.prefill(tokens)[1])
    assert cache.flush(30)


def _temps(directory) -> list[str]:
    return [f for f in os.listdir(directory) if f.startswith(TMP)]


def _populated(model, directory, seed: int = 1) -> list[int]:
    """A directory a cache of an earlier run filled with 2 pages and a state snapshot; its prompt."""
    p = _tokens(2 * PAGE, model.cfg.vocab_size, seed)
    c = _cache(model, directory)
    _store(model, c, p)
    c.close()
    return p


def _disk_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "cachetier.prefix_disk" and r.levelno >= logging.WARNING]


# --- ways to make a directory fail ------------------------------------------------------------------


def _sh(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@contextlib.contextmanager
def _mount(target, *args: str):
    """`mount ARGS TARGET` for the block, or skip where this process may not mount."""
    if os.geteuid() != 0 or shutil.which("mount") is None or not _sh("mount", *args, str(target)):
        pytest.skip("needs root with mount rights")
    try:
        yield
    finally:
        if not _sh("umount", str(target)):
            _sh("umount", "-l", str(target))


@contextlib.contextmanager
def _read_only_mount(directory):
    with _mount(directory, "--bind", str(directory)):
        if not _sh("mount", "-o", "remount,ro,bind", str(directory)):
            pytest.skip("cannot remount read-only")
        yield


def _refuse_writes(monkeypatch, directory, code: int) -> None:
    """Every creation, removal and rename under `directory` fails with `code` (as a read-only mount or a
    directory without write permission makes it fail, also for root)."""
    root = os.path.abspath(directory)
    inside = lambda p: os.path.abspath(os.fspath(p)).startswith(root)  # noqa: E731

    def fail(p):
        raise OSError(code, os.strerror(code), os.fspath(p))

    def guard(real, writes=lambda *a, **k: True):
        def f(path, *a, **k):
            if inside(path) and writes(*a, **k):
                fail(path)
            return real(path, *a, **k)
        return f

    monkeypatch.setattr(os, "open", guard(os.open, lambda flags, *a, **k: flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
    for name in ("remove", "unlink", "rename", "replace", "mkdir"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))


# --- a full disk ------------------------------------------------------------------------------------


def test_full_disk_counts_failed_writes_leaves_no_temporary_files_and_serves_from_memory(tiny_model, tmp_path, monkeypatch,
                                                                                     caplog):
    """Simulated: the data reaches the temporary file and `fsync` reports the disk full (where ENOSPC
    surfaces for buffered writes). Writes go on being tried: a full disk may drain."""
    vocab = tiny_model.cfg.vocab_size
    c = _cache(tiny_model, tmp_path)
    fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    caplog.set_level(logging.DEBUG, "cachetier.prefix_disk")
    p, q = _tokens(2 * PAGE, vocab, 2), _tokens(PAGE, vocab, 3)
    _store(tiny_model, c, p)  # 2 pages + 1 state
    _store(tiny_model, c, q)  # 1 page + 1 state
    st = c.stats()
    assert st.disk_write_errors == 5 and st.disk_errors == 5 and st.disk_writes == 0
    assert os.listdir(tmp_path) == []  # neither the temporary files nor half files
    assert len(_disk_warnings(caplog)) == 1  # once, not per part
    hit = c.acquire(p + [1], 2 * PAGE)  # served from memory
    assert hit.tokens == 2 * PAGE
    c.release(hit)
    c.check_integrity()
    monkeypatch.setattr(os, "fsync", fsync)  # space again: the next parts get their files
    r = _tokens(PAGE, vocab, 4)
    _store(tiny_model, c, r)
    assert c.stats().disk_writes == 2 and c.stats().disk_write_errors == 5
    c.close()


def test_a_real_full_tmpfs_and_a_restart_on_it(tiny_model, tmp_path, caplog):
    """A 64 KB tmpfs: page files (12 KB) fit, a state snapshot (66 KB) does not. Then a restart on it once
    it is completely full, holding 76 zero-byte temporary files of failed writes (what the old code left)."""
    vocab = tiny_model.cfg.vocab_size
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with _mount(mnt, "-t", "tmpfs", "-o", "size=64k", "tmpfs"):
        caplog.set_level(logging.DEBUG, "cachetier.prefix_disk")
        c = _cache(tiny_model, mnt / "actor")
        p = _tokens(2 * PAGE, vocab, 5)
        _store(tiny_model, c, p)
        st = c.stats()
        assert st.disk_writes == 2 and st.disk_write_errors == 1  # the state snapshot did not fit
        assert _temps(mnt / "actor") == []
        hit = c.acquire(p + [1], 2 * PAGE)
        assert hit.tokens == 2 * PAGE  # its state is still in memory
        c.release(hit)
        c.close()
        for i in range(76):
            (mnt / "actor" / f"{TMP}{i:032x}.seg.{1000 + i}").touch()
        with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):  # fill what is left
            while f.write(b"\0" * 4096):
                pass
        c2 = _cache(tiny_model, mnt / "actor")  # a restart on the full disk
        assert _temps(mnt / "actor") == []  # the leftovers are removed
        assert c2.stats().nodes == 2  # the pages that were written are found again
        _store(tiny_model, c2, p)  # the state again: fails again, counted, no leftover
        assert c2.stats().disk_write_errors == 1 and _temps(mnt / "actor") == []
        hit = c2.acquire(p + [1], 2 * PAGE)
        assert hit.tokens == 2 * PAGE and c2.stats().disk_reads == 2
        c2.release(hit)
        c2.check_integrity()
        c2.close()


# --- a directory that takes no writes ---------------------------------------------------------------


@pytest.fixture(params=["mount", "chmod", "patched"])
def read_only(request, monkeypatch):
    """Makes a directory read-only for the rest of the test, in each of the ways this process can."""
    stack = contextlib.ExitStack()

    def make(directory):
        if request.param == "mount":
            stack.enter_context(_read_only_mount(directory))
        elif request.param == "chmod":
            if os.geteuid() == 0:
                pytest.skip("root writes through a chmod")
            os.chmod(directory, 0o555)
            stack.callback(os.chmod, directory, 0o755)
        else:
            _refuse_writes(monkeypatch, directory, errno.EROFS)

    yield make
    stack.close()


def test_read_only_directory_is_still_a_source_of_hits(tiny_model, tmp_path, read_only, caplog):
    vocab = tiny_model.cfg.vocab_size
    p = _populated(tiny_model, tmp_path)
    (tmp_path / f"{TMP}leftover.seg.1").touch()  # an earlier run's failed write
    (tmp_path / "ffff.seg").write_bytes(b"not ours")
    before = sorted(os.listdir(tmp_path))
    read_only(tmp_path)
    caplog.set_level(logging.DEBUG, "cachetier.prefix_disk")

    c = _cache(tiny_model, tmp_path)  # starts
    assert not c.disk.writable
    assert c.stats().nodes == 2 and c.stats().state_snapshots == 1
    hit = c.acquire(p + [1], 2 * PAGE)  # hits from the files
    assert hit.tokens == 2 * PAGE and c.stats().disk_reads == 3
    c.release(hit)
    q = _tokens(2 * PAGE, vocab, 6)
    _store(tiny_model, c, q)  # kept in memory, no file attempted
    hit = c.acquire(q + [1], 2 * PAGE)
    assert hit.tokens == 2 * PAGE
    c.release(hit)
    st = c.stats()
    assert st.disk_writes == 0 and st.disk_write_errors == 1  # the start-up probe, not one per part
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing removed
    assert len(_disk_warnings(caplog)) == 1
    c.check_integrity()
    c.close()


def test_read_only_directory_with_a_corrupt_file_is_a_miss(tiny_model, tmp_path, read_only):
    p = _populated(tiny_model, tmp_path)
    state = next(tmp_path.glob("*.state"))
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    read_only(tmp_path)
    c = _cache(tiny_model, tmp_path)
    hit = c.acquire(p + [1], 2 * PAGE)  # the file cannot be removed: it only leaves the index
    assert hit.tokens == 0 and c.stats().disk_read_errors == 1 and c.stats().state_snapshots == 0
    c.release(hit)
    assert state.exists()
    c.check_integrity()
    c.close()


def test_a_directory_that_stops_taking_writes_is_written_no_more(tiny_model, tmp_path, monkeypatch, caplog):
    """Remounted read-only while serving: the first failure says so, later parts are not tried."""
    vocab = tiny_model.cfg.vocab_size
    c = _cache(tiny_model, tmp_path)
    _store(tiny_model, c, _tokens(PAGE, vocab, 7))
    assert c.stats().disk_writes == 2
    _refuse_writes(monkeypatch, tmp_path, errno.EROFS)
    caplog.set_level(logging.DEBUG, "cachetier.prefix_disk")
    for s in (8, 9):
        _store(tiny_model, c, _tokens(2 * PAGE, vocab, s))
    st = c.stats()
    assert st.disk_write_errors == 1 and st.disk_writes == 2 and not c.disk.writable
    assert _temps(tmp_path) == [] and len(_disk_warnings(caplog)) == 1
    c.check_integrity()
    c.close()


# --- a directory that cannot be read or made --------------------------------------------------------


@pytest.mark.parametrize("how", ["chmod", "patched"])
def test_unreadable_directory_starts_empty_and_serves_from_memory(tiny_model, tmp_path, monkeypatch, how):
    vocab = tiny_model.cfg.vocab_size
    _populated(tiny_model, tmp_path)
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root reads through a chmod")
        os.chmod(tmp_path, 0)
    else:
        _refuse_writes(monkeypatch, tmp_path, errno.EACCES)
        listdir = os.listdir

        def refuse(path="."):
            if os.path.abspath(path) == str(tmp_path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return listdir(path)

        monkeypatch.setattr(os, "listdir", refuse)
    try:
        c = _cache(tiny_model, tmp_path)
        st = c.stats()
        assert st.nodes == 0 and st.disk_read_errors == 1 and st.disk_write_errors == 1
        q = _tokens(2 * PAGE, vocab, 10)
        _store(tiny_model, c, q)
        hit = c.acquire(q + [1], 2 * PAGE)
        assert hit.tokens == 2 * PAGE and c.stats().disk_write_errors == 1
        c.release(hit)
        c.check_integrity()
        c.close()
    finally:
        if how == "chmod":
            os.chmod(tmp_path, 0o755)


def test_a_directory_that_cannot_be_made(tiny_model, tmp_path):
    """`--prefix-cache-dir` names a file: neither created nor listed, both counted; the cache runs in memory."""
    (tmp_path / "a-file").write_bytes(b"")
    c = _cache(tiny_model, tmp_path / "a-file")
    st = c.stats()
    assert st.disk_write_errors == 1 and st.disk_read_errors == 1 and not c.disk.writable
    p = _tokens(PAGE, tiny_model.cfg.vocab_size, 11)
    _store(tiny_model, c, p)
    assert c.acquire(p + [1], PAGE).tokens == PAGE
    c.close()


# --- damaged files of earlier runs ------------------------------------------------------------------


def test_damaged_files_at_start_up_are_removed(tiny_model, tmp_path):
    """Zero-byte, truncated, unparsable and wrongly shaped headers: removed at start, the rest of the cache
    found; only the temporary files of earlier runs are removed without looking."""
    p = _populated(tiny_model, tmp_path)
    bad = {"0" * 32 + ".seg": b"", "1" * 32 + ".seg": MAGIC + b"\x01", "2" * 32 + ".state": MAGIC + struct.pack("<I", 3) + b"{x]",
           "3" * 32 + ".seg": MAGIC + struct.pack("<I", 3) + b"[1]", "4" * 32 + ".seg": MAGIC + struct.pack("<I", 4) + b"null"}
    for name, raw in bad.items():
        (tmp_path / name).write_bytes(raw)
    for i in range(76):
        (tmp_path / f"{TMP}{i:032x}.state.{2000 + i}").touch()
    c = _cache(tiny_model, tmp_path)
    assert c.stats().nodes == 2 and c.stats().state_snapshots == 1
    assert not set(bad) & set(os.listdir(tmp_path)) and _temps(tmp_path) == []
    assert c.acquire(p + [1], 2 * PAGE).tokens == 2 * PAGE
    c.close()
