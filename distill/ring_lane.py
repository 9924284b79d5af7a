"""The publisher's same-host lane: its shared-memory ring (distill/shm.py), the stamps of its slots,
and the fall-back to frames when a sample finds no room.

`RingLane` is one object the Publisher holds whether or not a ring exists (`transport.shm: off`, or
`auto` where /dev/shm is unusable): then `active` is False, `slot` returns None and every sample
travels in frames. Called from the producer's threads (`slot`; `memory` once, at start), the spool reader threads (`slot`) and
the Publisher's I/O thread (`place`, `free`, `say_full`); the ring's own lock guards its free list.
"""

from __future__ import annotations

import logging
import secrets
import threading

import torch

from distill.config import TransportConfig
from distill.errors import TransportError
from distill.shm import RingSlot, ShmRing, clean_stale, ring_name
from distill.spool import disk_room
from distill.students import Entry

log = logging.getLogger("distill.transport")


class RingLane:
    """Slots of the teacher's ring for same-host students; None-safe when there is no ring."""

    def __init__(self, cfg: TransportConfig, tid: str):
        self.cfg = cfg
        self.tid = tid
        self._ring: ShmRing | None = None
        self._stamp = secrets.randbits(40) << 20  # slot stamps: unique per publisher
        self._stamp_lock = threading.Lock()
        self._full_said: set[str] = set()  # causes of ring-full sends already logged

    def open(self) -> RingLane:
        """Create the ring (`transport.shm`: off -> none; on -> TransportError when it cannot be
        made; auto -> a warning and frames). Removes the rings of dead teachers first."""
        if self.cfg.shm == "off":
            return self
        clean_stale(self.cfg.shm_dir)
        try:
            self._ring = ShmRing(self.cfg.shm_dir, ring_name(self.tid), self.cfg.shm_bytes)
        except OSError as e:
            if self.cfg.shm == "on":
                raise TransportError(f"cannot create shared-memory ring in {self.cfg.shm_dir}: {e}") from None
            log.warning("shared-memory ring unavailable (%s); all samples travel in frames", e)
        return self

    @property
    def active(self) -> bool:
        return self._ring is not None

    @property
    def path(self):
        return self._ring.path if self._ring is not None else None

    @property
    def used_bytes(self) -> int:
        return self._ring.used_bytes if self._ring is not None else 0

    def welcome(self) -> list | None:
        """What WELCOME tells a student about the ring: [path, nonce], or None (frames only)."""
        return [str(self._ring.path), self._ring.nonce] if self._ring is not None else None

    def slot(self, specs: dict[str, tuple[list[int], torch.dtype]]) -> RingSlot | None:
        """Writable tensors in one fresh slot (a new stamp), or None: no ring, or no room."""
        if self._ring is None:
            return None
        with self._stamp_lock:
            self._stamp += 1
            stamp = self._stamp
        return self._ring.slot(specs, stamp)

    def memory(self) -> tuple[int, int] | None:
        """(address, length) of the whole ring, every page reserved (`ShmRing.reserve_all`), or
        None: no ring, or its filesystem cannot hold all of it."""
        return self._ring.reserve_all() if self._ring is not None else None

    def free(self, off: int) -> None:
        """Give back the slot at `off` (its stamp is zeroed before any reuse)."""
        if self._ring is not None:
            self._ring.free(off)

    def free_entry(self, e: Entry) -> None:
        """Give back the slot a queued sample's tensors live in, if any."""
        if e.shm is not None and self._ring is not None:
            self._ring.free(e.shm[0])
            e.shm = None

    def place(self, e: Entry) -> bool:
        """Copy the sample's tensors into one slot and keep only views of it (the original tensors
        can be freed). False when the ring has no room: the sample travels in frames."""
        slot = self.slot({k: (list(t.shape), t.dtype) for k, t in e.sample.tensors.items()})
        if slot is None:
            return False
        for k, t in e.sample.tensors.items():
            if t.numel():
                slot.tensors[k].copy_(t)
        e.shm = (slot.offset, slot.offsets, slot.stamp)
        e.sample.tensors = dict(slot.tensors)
        return True

    def say_full(self, nbytes: int, in_flight: int, read_ahead: int) -> None:
        """Say once per cause (the filesystem under the ring, or the ring itself) why a same-host
        send fell back to frames, and what to change."""
        cause = "fs" if self._ring.fs_full else "ring"
        if cause in self._full_said:
            return
        self._full_said.add(cause)
        size_mb = nbytes / 1e6
        if cause == "fs":
            room = disk_room(self.cfg.shm_dir)
            log.warning(
                "no room for a %.1f MB ring slot: the filesystem of %s is full (%s) before the "
                "%.0f MB ring (transport.shm_bytes) is; such samples reach same-host students in "
                "frames, which is slower (counted in shm_full). Give %s more room (in a container: "
                "docker run --shm-size, or --ipc=host) or lower transport.shm_bytes. Said once.",
                size_mb, self.cfg.shm_dir, room[2] if room else "unreadable", self.cfg.shm_bytes / 1e6,
                self.cfg.shm_dir,
            )  # fmt: skip
            return
        log.warning(
            "shared-memory ring full (%.1f of %.1f MB in use: %d samples in flight to students, %d "
            "read ahead from the spool); this %.1f MB sample and the next ones that find no room "
            "reach same-host students in frames, which is slower (counted in shm_full). Make "
            "transport.shm_bytes hold the students' credit_samples plus spool.read_ahead samples, "
            "or lower transport.credit_samples. Said once.",
            self._ring.used_bytes / 1e6,
            self.cfg.shm_bytes / 1e6,
            in_flight,
            read_ahead,
            size_mb,
        )

    def close(self) -> None:
        """Remove the ring file (students that still map it keep their pages until they unmap)."""
        if self._ring is not None:
            self._ring.close()
