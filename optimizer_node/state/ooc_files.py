"""One version of a bucket's state file, for :mod:`optimizer_node.state.ooc_store`: writing it, reading it
back checked, and the buffers and checksums both use.

A state file is param, exp_avg, exp_avg_sq as fp32, back to back (the checkpoint file format). The
reads and writes run on the store's I/O threads and touch nothing but the file and the buffer they
are handed; every write returns the :class:`FileInfo` a later read checks (size, inode, mtime,
:data:`DIGEST`).

Direct I/O. With ``direct`` the aligned bulk of a file moves between the disk and the state buffer
with ``O_DIRECT``: no copy through the page cache, nothing left there to drop, no CPU spent on
either (on a 2-core node the update and the checksums need it). The buffers start on a huge-page
boundary so that each request is as large as the device takes (see :func:`state_buffer`). What is
not whole blocks (the end of an odd-sized bucket, a buffer that is not aligned) goes through the
page cache.

Buffered I/O moves a file in pieces that stay in a core's cache between the copy and the checksum
(:data:`READ_PIECE`, :data:`WRITE_PIECE`): a read hashes each piece the kernel just copied in, a write
hashes each piece and hands it to the kernel while it is still cached, so the state's bytes cross
the memory bus once each way instead of twice.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from optimizer_node.state.storage import StorageError
from transport.host_memory import trim_host_heap

log = logging.getLogger(__name__)

# Alignment of memory, offsets and lengths for O_DIRECT: a page, which covers every logical block
# size Linux file systems use (512 B or 4 KiB).
ALIGN = mmap.PAGESIZE
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0: not Linux; direct I/O is never used
HUGE_PAGE = 2 << 20  # transparent huge page size on x86-64 and most arm64 kernels
# Pieces of a buffered read or write, hashed while the kernel's copy left them in cache. Measured on
# a 48 MiB state file in the page cache, one thread: reads 16.1 GB/s in 512 KiB pieces against 15.1
# whole (copy, then hash), writes 17.3 GB/s in 1 MiB pieces against 9.2 whole (hash, then copy).
READ_PIECE = 512 << 10
WRITE_PIECE = 1 << 20


@dataclass(frozen=True, slots=True)
class FileInfo:
    """What the node wrote to a state file, checked when it reads it back."""

    step: int
    size: int
    inode: int
    mtime_ns: int
    digest: int  # DIGEST of the file
    param_digest: int  # of the parameter third alone: a fetch reads only that


DIGEST = "xxh3_64"
"""The checksum of state files (and of an out-of-core node's checkpoint files in the manifest): XXH3,
64 bits. Every byte of state read back or written out of core is checksummed, so on a small node
the checksums were most of the store's CPU: XXH3 runs at memory speed (31 GB/s on one core where
CRC-32 did 15 through libdeflate and 6.7 through zlib), with no system library."""


def digest(data: memoryview | bytes) -> int:
    """The :data:`DIGEST` of ``data``. Through a hasher's ``update``, which lets go of the GIL while it
    runs (``xxh3_64_intdigest`` holds it: the node's serve loop stalled behind the I/O threads)."""
    hasher = xxhash.xxh3_64()
    hasher.update(data)
    return hasher.intdigest()


def state_digests(data: memoryview, param_bytes: int | None = None) -> tuple[int, int]:
    """Digests of a state file's bytes ``data``: of the whole, and of its first ``param_bytes`` (the
    parameters, what a fetch reads; default a third: fp32 moments) alone, in one pass."""
    cut = len(data) // 3 if param_bytes is None else param_bytes
    hasher = xxhash.xxh3_64()
    hasher.update(data[:cut])
    param = hasher.intdigest()
    hasher.update(data[cut:])
    return hasher.intdigest(), param


def _pieces(length: int, piece: int, cut: int) -> list[tuple[int, int]]:
    """``(start, stop)`` pieces of at most ``piece`` bytes covering ``0 .. length``, one of them ending
    at ``cut`` (where the parameter third's digest is taken)."""
    bounds = sorted({*range(0, length, piece), cut, length})
    return [(start, stop) for start, stop in itertools.pairwise(bounds) if start < stop]


def _write_hashing(fd: int, data: memoryview, param_bytes: int | None = None) -> tuple[int, int]:
    """Write ``data`` at the start of the file through the page cache, piece by piece, each hashed just
    before the kernel copies it; returns :func:`state_digests` of ``data``."""
    hasher = xxhash.xxh3_64()
    third = len(data) // 3 if param_bytes is None else param_bytes
    param = hasher.intdigest()  # of nothing: a file of under 3 bytes has an empty parameter third
    for start, stop in _pieces(len(data), WRITE_PIECE, third):
        view = data[start:stop]
        hasher.update(view)
        if stop == third:
            param = hasher.intdigest()
        done = start
        while done < stop:
            moved = os.pwrite(fd, data[done:stop], done)
            if moved <= 0:  # a regular file takes every byte or raises; do not spin if one does not
                raise OSError(errno.EIO, f"a write of {stop - done} bytes moved none")
            done += moved
    return hasher.intdigest(), param


def _read_hashing(fd: int, data: memoryview) -> tuple[int, int]:
    """Read the start of the file into ``data`` through the page cache, piece by piece, each hashed
    while the kernel's copy left it in cache; returns the bytes read (short at the file's end) and
    their digest."""
    hasher = xxhash.xxh3_64()
    done = 0
    for _start, stop in _pieces(len(data), READ_PIECE, 0):
        while done < stop:
            moved = os.preadv(fd, [data[done:stop]], done)
            if moved == 0:
                return done, hasher.intdigest()
            hasher.update(data[done : done + moved])
            done += moved
    return done, hasher.intdigest()


def state_buffer(numel: int) -> torch.Tensor:
    """A (numel,) fp32 tensor in its own page-aligned anonymous mapping, returned to the OS when the
    tensor and its views are freed. Its whole 2 MiB blocks are transparent huge pages where the
    kernel has them: a direct request is at most ``max_segments`` physically contiguous pieces
    (254 on virtio), so on 4 KiB pages it carries 1 MiB and on huge pages the device's maximum (4
    MiB): measured 3.0 GB/s reads and 3.6 GB/s writes against 1.25 and 2.1 on 4 KiB pages."""
    nbytes = max(4 * numel, 1)
    huge = nbytes // HUGE_PAGE * HUGE_PAGE if HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE") else 0
    # Room to start at a huge-page boundary; the slack is never touched, so it is never resident.
    mapping = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() % HUGE_PAGE if huge else 0
    if huge:
        try:  # whole blocks only: a huge page under the last partial one would be resident past the state
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, huge)
            mapping.madvise(mmap.MADV_NOHUGEPAGE, offset + huge, len(mapping) - offset - huge)  # also with THP "always"
        except OSError:  # no transparent huge pages in this kernel: 4 KiB pages, smaller requests
            pass
    return torch.frombuffer(mapping, dtype=torch.float32, count=numel, offset=offset)  # the tensor keeps the mapping alive


class SpareStateBuffers:
    """Freed state buffers by size, reused: memory for state is allocated once, up to the budget,
    instead of being freed to (and fragmenting) the heap at every eviction."""

    def __init__(self) -> None:
        self._spare: dict[int, list[torch.Tensor]] = {}  # elements -> buffers of that many

    def give(self, flat: torch.Tensor) -> None:
        """Keep ``flat`` (a bucket's state buffer, no longer in use) for the next bucket of its size."""
        self._spare.setdefault(flat.numel(), []).append(flat)

    def take(self, numel: int, *, room: int) -> torch.Tensor:
        """A buffer of ``numel`` fp32: a spare one, else a new one; ``room`` is what the budget has
        left, which spare buffers of other sizes count against: they are given back first where both
        would not fit."""
        spare = self._spare.get(numel)
        if spare:
            return spare.pop()
        spare_bytes = 4 * sum(b.numel() for buffers in self._spare.values() for b in buffers)
        if spare_bytes and spare_bytes + 4 * numel > room:
            self._spare.clear()
            trim_host_heap()
        return state_buffer(numel)


def probe_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` take aligned ``O_DIRECT`` writes and reads (tmpfs before
    Linux 6.6, some network and FUSE file systems do not)."""
    if not O_DIRECT:
        return False
    probe = directory / ".direct-probe"
    block = mmap.mmap(-1, ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            os.pwrite(fd, block, 0)
        finally:
            os.close(fd)
        fd = os.open(probe, os.O_RDONLY | O_DIRECT)
        try:
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _transfer(fd: int, data: memoryview, *, write: bool, direct: bool) -> tuple[int, bool]:
    """Write ``data`` to, or read it from, the start of the file; ``fd`` was opened with ``O_DIRECT``
    iff ``direct``. Returns the bytes moved (short only at the end of a file being read) and whether
    any went through the page cache."""
    done = 0
    aligned_end = len(data) - len(data) % ALIGN
    cached = False
    while done < len(data):
        if direct and (done % ALIGN or done >= aligned_end):  # the rest is not whole blocks
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
            direct = False
        end = aligned_end if direct else len(data)
        cached |= not direct
        moved = os.pwrite(fd, data[done:end], done) if write else os.preadv(fd, [data[done:end]], done)
        if moved == 0:
            break
        done += moved
    return done, cached


def _direct_ok(direct: bool, data: memoryview, tensor: torch.Tensor) -> bool:
    return direct and bool(O_DIRECT) and tensor.data_ptr() % ALIGN == 0 and len(data) >= ALIGN


def write_version(path: Path, flat: torch.Tensor, step: int, *, sync: bool, direct: bool, overwrite: bool, param_bytes: int | None = None) -> FileInfo:
    """Write ``flat`` to ``path``: a new file, or with ``overwrite`` an existing one of the same size
    (a retired version the store reuses). With ``sync`` the data is on the disk and out of the page
    cache when this returns. A failed write removes the file. ``param_bytes``: where the parameters
    end (default a third of the file: fp32 moments)."""
    data = memoryview(flat.numpy()).cast("B")
    direct = _direct_ok(direct, data, flat)
    flags = os.O_WRONLY | (0 if overwrite else os.O_CREAT | os.O_EXCL) | (O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if overwrite and os.fstat(fd).st_size != len(data):
            os.ftruncate(fd, len(data))
        if direct:  # the device reads the buffer: nothing is in cache to hash, so hash first
            whole, param = state_digests(data, param_bytes)
            _, cached = _transfer(fd, data, write=True, direct=True)
        else:
            (whole, param), cached = _write_hashing(fd, data, param_bytes), True
        if sync:
            os.fdatasync(fd)  # also for direct writes: the new blocks' metadata and the disk's cache
            if cached:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        stat = os.fstat(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return FileInfo(step, stat.st_size, stat.st_ino, stat.st_mtime_ns, whole, param)


def read_checked(path: Path, into: torch.Tensor, expected: FileInfo, *, expected_digest: int, sync: bool, direct: bool) -> None:
    """Read the start of a state file into ``into`` (the whole file, or only its parameter third for
    a fetch) and check that the file is the one the node wrote and the bytes match ``expected_digest``."""
    data = memoryview(into.numpy()).cast("B")
    direct = _direct_ok(direct, data, into)
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        stat = os.fstat(fd)
        if (stat.st_size, stat.st_ino, stat.st_mtime_ns) != (expected.size, expected.inode, expected.mtime_ns):
            raise StorageError(f"{path} was changed outside the node (size {stat.st_size}, expected {expected.size})")
        if direct:
            got, cached = _transfer(fd, data, write=False, direct=True)
            found = digest(data[:got])
        else:
            (got, found), cached = _read_hashing(fd, data), True
        if sync and cached:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if got != len(data) or found != expected_digest:
        raise StorageError(f"{path} does not hold what the node wrote (its checksum differs)")


def describe_file(path: Path, step: int, *, param_bytes: int) -> FileInfo:
    """The :class:`FileInfo` of a state file the node did not write (a checkpoint's, adopted)."""
    stat = path.stat()
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while param_bytes > 0 and (block := handle.read(min(8 << 20, param_bytes))):
            hasher.update(block)
            param_bytes -= len(block)
        param = hasher.intdigest()
        while block := handle.read(8 << 20):
            hasher.update(block)
    return FileInfo(step, stat.st_size, stat.st_ino, stat.st_mtime_ns, hasher.intdigest(), param)


def link_or_copy(source: Path, path: Path, *, durable: bool) -> None:
    """``path`` as a hard link to ``source`` (no copy: a version never changes once written), or a copy
    where they lie on different file systems; with ``durable``, on the disk when this returns."""
    try:
        os.link(source, path)
    except OSError:  # another file system: copy instead
        if durable:
            os.sync()
        with open(source, "rb") as reader, open(path, "wb") as writer:
            while block := reader.read(8 << 20):
                writer.write(block)
    if durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def reusable(path: Path, info: FileInfo) -> bool:
    """Whether the file of a retired version may take the next one in place: only if nothing else
    links it (a checkpoint's data must not change) and it is still the file the node wrote. A new
    file instead costs allocating its blocks, committing them in ``fdatasync``, and freeing (on a
    ``discard`` mount, trimming) the old ones: measured 1.4x slower steps."""
    try:
        stat = path.stat()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot stat %s: %s", path, exc)
        return False
    return stat.st_nlink == 1 and (stat.st_ino, stat.st_size, stat.st_mtime_ns) == (info.inode, info.size, info.mtime_ns)
