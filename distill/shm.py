"""Same-host data path: a ring of slots in a shared-memory file that the teacher writes once and
students map read-only.

The teacher owns one `ShmRing` (a sparse file under /dev/shm). A sample's tensors are copied into
one slot; the ZeroMQ message then carries only the header with `shm = [segment, [offsets]]`. A
student maps the segment once (`ShmReader`) and decodes tensors as zero-copy views. A slot is freed
when the sample is acknowledged (or its student is declared gone), so a view stays valid until then.

Every slot starts with a 64-byte stamp word: the teacher writes a fresh stamp there before the
slot's bytes, and zero when it frees the slot (before any reuse). The sample's header names the
stamp; a student that copies a sample's bytes and then still reads that stamp copied that sample's
bytes (`ShmReader.stamp`). A student frozen past the heartbeat timeout finds its stale samples out
this way instead of training on a slot that now holds another sample.

Ring files are named `distill-<pid>-<teacher id>.ring`; a teacher removes its own on close, and
`clean_stale` removes those whose owner pid is gone (a SIGKILLed teacher) at the next start.

The file is sparse: its pages cost memory only once used. Each slot's pages are reserved with
posix_fallocate before any byte is written, so a tmpfs smaller than the ring (a container's 64 MB
/dev/shm) makes `alloc` return None (the sample travels in frames) instead of a SIGBUS on the
first write past the filesystem's end.

Whether a student can use the ring is found out, not assumed: the teacher sends the segment path
and a random nonce (written at offset 0) in WELCOME; the student maps the file and compares the
nonce. A student on another host cannot open the file (or reads another nonce) and gets frames.
"""

from __future__ import annotations

import bisect
import errno
import logging
import math
import mmap
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from distill.protocol import tensor_view

log = logging.getLogger(__name__)

ALIGN = 4096  # slots start on page boundaries (also keeps every dtype aligned)
HEADER = ALIGN  # first page: the nonce
STAMP_BYTES = 64  # each slot's first 64 bytes: its stamp word (8 bytes used)
_STAMP = struct.Struct("<Q")


@dataclass
class RingSlot:
    """Tensors that live in one slot of the publisher's shared-memory ring (Publisher.ring_slot).

    Slot layout: the stamp word (STAMP_BYTES), then each tensor's bytes in `tensors` order, each
    starting on a 64-byte boundary (`offsets`: absolute offsets in the ring)."""

    tensors: dict[str, torch.Tensor]
    offset: int  # slot start in the ring (its stamp word)
    offsets: list[int]  # per-tensor start, in `tensors` order
    stamp: int = 0


def _pad(n: int) -> int:
    """Tensors of one ring slot start on 64-byte boundaries."""
    return (n + 63) // 64 * 64


def ring_name(tid: str) -> str:
    return f"distill-{os.getpid()}-{tid}.ring"


def clean_stale(directory: str) -> list[Path]:
    """Remove ring files of teachers whose process is gone (a SIGKILL leaves its ring behind)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith("distill-") and name.endswith(".ring")):
            continue
        pid_txt = name[len("distill-") :].split("-", 1)[0]
        if not pid_txt.isdigit():
            continue
        try:
            os.kill(int(pid_txt), 0)
            continue  # alive (or another user's: PermissionError below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        p = Path(directory) / name
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    if removed:
        log.info("removed %d stale shared-memory ring(s) of dead teachers: %s", len(removed), removed)
    return removed


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def spec_sizes(specs: dict[str, tuple[list[int], torch.dtype]]) -> list[int]:
    """Bytes of each (shape, dtype) in `specs`, in order (what a slot for them holds, unpadded)."""
    return [math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs.values()]


class _Backed:
    """Byte ranges of the ring file whose pages are reserved (posix_fallocate), as sorted disjoint
    intervals. Never shrinks: freed slots keep their pages for the next sample."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []

    def covers(self, a: int, b: int) -> bool:
        i = bisect.bisect_right(self.starts, a) - 1
        return i >= 0 and self.ends[i] >= b

    def add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self.ends, a)  # the first interval ending at or after a
        j = bisect.bisect_right(self.starts, b)  # past the last one starting at or before b
        if i < j:
            a, b = min(a, self.starts[i]), max(b, self.ends[j - 1])
        self.starts[i:j] = [a]
        self.ends[i:j] = [b]


class ShmRing:
    """A first-fit allocator over one shared-memory file (teacher side)."""

    def __init__(self, directory: str, name: str, size: int):
        self.path = Path(directory) / name
        self.size = _round_up(size) + HEADER
        self.nonce = secrets.token_hex(16)
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(self._fd, self.size)  # sparse: pages cost memory only once reserved
            try:
                os.posix_fallocate(self._fd, 0, HEADER)  # no space: OSError here, not SIGBUS later
                self._reserve = True
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self._reserve = False  # a filesystem without fallocate: a plain sparse file
            self._mm = mmap.mmap(self._fd, self.size)
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise
        self._mm[: len(self.nonce)] = self.nonce.encode()
        self.view = memoryview(self._mm)
        # Free list of (offset, length), sorted by offset, coalesced on free.
        self._free: list[tuple[int, int]] = [(HEADER, self.size - HEADER)]
        self._used: dict[int, int] = {}  # offset -> length of allocated slot
        self._backed = _Backed()
        self._backed.add(0, HEADER)
        self.fs_full = 0  # allocations refused because the filesystem had no pages left
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of at least `nbytes` whose pages are reserved, or None when the
        ring (or the filesystem under it: `fs_full` counts those) has no room."""
        need = _round_up(max(nbytes, 1))
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + need, length - need)
                    self._used[off] = need
                    break
            else:
                return None
            if self._reserve and not self._backed.covers(off, off + need):
                try:
                    os.posix_fallocate(self._fd, off, need)
                except OSError as err:
                    if err.errno in (errno.ENOSPC, errno.EDQUOT):
                        self._release(off)
                        self.fs_full += 1
                        return None
                    # A filesystem without fallocate: write unreserved, as a plain sparse file.
                    log.warning("cannot reserve ring pages in %s (%s); writing unreserved", self.path, err)
                    self._reserve = False
                self._backed.add(off, off + need)
            return off

    def slot(self, specs: dict[str, tuple[list[int], torch.dtype]], stamp: int) -> RingSlot | None:
        """A slot for tensors of these (shape, dtype), stamped `stamp`, as writable tensor views; None
        when the ring has no room."""
        sizes = spec_sizes(specs)
        off = self.alloc(STAMP_BYTES + sum(_pad(n) for n in sizes))
        if off is None:
            return None
        self.set_stamp(off, stamp)  # before any byte of the sample
        tensors, offsets, cur = {}, [], off + STAMP_BYTES
        for (name, (shape, dt)), n in zip(specs.items(), sizes, strict=True):
            tensors[name] = (
                tensor_view(self.view[cur : cur + n], dt, list(shape)) if n else torch.empty(shape, dtype=dt)
            )
            offsets.append(cur)
            cur += _pad(n)
        return RingSlot(tensors, off, offsets, stamp)

    def reserve_all(self) -> tuple[int, int] | None:
        """(address, length) of the whole mapping with every page of the file reserved now, for a
        producer that registers the ring with a device and copies into slots directly (the ring then
        costs its whole size in memory from the start); None when the filesystem cannot reserve it
        (no room, or no posix_fallocate: pinning unreserved pages could SIGBUS)."""
        if not self._reserve:
            return None
        try:
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError as err:
            log.info("cannot reserve the whole %d-byte ring in %s: %s", self.size, self.path, err)
            return None
        with self._lock:
            self._backed.add(0, self.size)
        # (the tensor only reads the address; it is dropped at once, releasing its export)
        return torch.frombuffer(self.view, dtype=torch.uint8).data_ptr(), self.size

    def set_stamp(self, off: int, stamp: int) -> None:
        """Write a slot's stamp word (before its bytes on alloc; zero on free)."""
        self._mm[off : off + 8] = _STAMP.pack(stamp)

    def free(self, off: int) -> None:
        self.set_stamp(off, 0)  # readers holding this slot's samples see it is no longer theirs
        with self._lock:
            self._release(off)

    def _release(self, off: int) -> None:
        """(Under the lock) The slot at `off` goes back to the free list."""
        length = self._used.pop(off)
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, length))
        # Coalesce with the next and previous free ranges.
        if i + 1 < len(self._free) and off + length == self._free[i + 1][0]:
            self._free[i] = (off, length + self._free[i + 1][1])
            self._free.pop(i + 1)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            self._free.pop(i)

    def close(self) -> None:
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


class ShmReader:
    """Read-only mappings of teachers' rings (student side)."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}

    def attach(self, path: str, nonce: str) -> bool:
        """Map `path` if it holds `nonce`; False if this host cannot see that ring."""
        if path in self._maps:
            return True
        try:
            fd = os.open(path, os.O_RDONLY)
        except (OSError, ValueError):  # ValueError: a NUL byte in a path sent by a bad peer
            return False
        try:
            mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        if mm[: len(nonce)] != nonce.encode():
            mm.close()
            return False
        self._maps[path] = (mm, memoryview(mm))
        return True

    def resolve(self, path: str, off: int, nbytes: int) -> memoryview:
        entry = self._maps.get(path)
        if entry is None:
            raise ValueError(f"segment {path!r} is not mapped")
        mm, view = entry
        if off < HEADER or off + nbytes > len(mm):
            raise ValueError(f"slot [{off}, {off + nbytes}) outside segment of {len(mm)} bytes")
        return view[off : off + nbytes]

    def detach_unused(self, keep: set[str]) -> list[str]:
        """Unmap rings not in `keep` that no sample views any more (a restarted teacher's old ring:
        its pages stay allocated in /dev/shm while mapped). Returns the paths unmapped."""
        gone = []
        for path in [p for p in self._maps if p not in keep]:
            mm, view = self._maps[path]
            try:
                view.release()
                mm.close()  # BufferError while a received sample's tensor still views the map
            except BufferError:
                self._maps[path] = (mm, memoryview(mm))  # still mapped: keep resolving it
                continue
            del self._maps[path]
            gone.append(path)
        return gone

    def stamp(self, path: str, off: int) -> int | None:
        """The stamp word at `off` of a mapped segment (None if not mapped or out of range)."""
        entry = self._maps.get(path)
        if entry is None or off < HEADER or off + 8 > len(entry[0]):
            return None
        try:
            return _STAMP.unpack_from(entry[0], off)[0]
        except ValueError:  # unmapped meanwhile
            return None

    def close(self) -> None:
        for mm, view in self._maps.values():
            try:
                view.release()
                mm.close()
            except BufferError:
                pass
        self._maps.clear()
