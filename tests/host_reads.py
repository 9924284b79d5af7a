"""Counting the host's reads of device values (`.item()`, `bool(t)`, `nonzero`) in a block of
PyTorch work: on a GPU each one makes the host wait for the device."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

READS = ("_local_scalar_dense", "is_nonzero", "nonzero")


class HostReads(TorchDispatchMode):
    """`with HostReads() as r: ...`, then `r.n`: the reads seen inside the block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READS:
            self.n += 1
        return func(*args, **(kwargs or {}))
