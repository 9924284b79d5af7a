"""From teacher Samples to padded training batches. The two sample sources (stream, spool) live in
student/sources.py, the errors in student/errors.py (`StudentError` is re-exported here).

A Sample carries `hidden_states` [T, n_layers, H] (layer ids in `sample.layers`) and `token_ids`
[T]. Received tensors are zero-copy read-only views that die at `ack`, so `collate` copies what it
needs into fresh tensors; the Sample objects themselves are only kept to be acknowledged after the
optimizer step that used them.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from distill import fp8
from distill.protocol import Sample
from student.errors import StudentError as StudentError
from student.packing import Segments


@dataclass
class Batch:
    """A micro-batch (right padding), on the host as `collate` makes it or on the device after `to`.

    Attributes:
        input_ids: [B, T] int64, 0 on padding.
        mask: [B, T] bool, True on real tokens.
        teacher: the teacher states for the n layer ids in `layer_ids`, in the dtype the teacher sent
            (bf16 from a bf16 teacher: the loss upcasts on the device). Padded [B, T, n, H_t] with 0
            on padding, or, when `lengths` is set (what `collate` returns), packed: [N, n, H_t], the
            real tokens of every row one after the other (N = sum(lengths)); `to` pads it on the
            target device, so padding never costs host memory traffic or copy bandwidth.
        layer_ids: teacher layer ids of `teacher`'s layer dimension.
        lengths: real tokens per row when `teacher` is packed; None when it is padded.
        segments: the packed layout (`student.batch_layout: packed`, `collate(pack=True)`): every
            sample one after another in one row, input_ids and mask [1, N] with no padding,
            `segments` their lengths in row order; `to` adds `packing` (student/packing.py: each
            sample's positions, its offsets for variable-length attention, its last token). None:
            one sample per row, right padding.
        loss_mask: [B, T] bool, the teacher's per-token loss mask (`Sample` tensor `loss_mask`):
            True on tokens to train on (`student.loss_on: masked`), False on padding; all True on
            the real tokens of a sample that has none (older teachers and spool files).
        held: [B, T] bool, True where `teacher` holds the teacher's states; None: on every real
            token. Samples with `positions` (teacher.capture: loss_mask) hold some positions only:
            `teacher` is 0 elsewhere and the losses that read it count held positions only.
        scale: on the host only, for fp8 samples (teacher.hidden_dtype: fp8): `teacher` is float8
            e4m3 and `scale` float32 [N, n] (or [B, T, n] padded), one per token and layer; `to`
            uploads both and dequantizes on the device into `out_dtype` (the teacher's model
            dtype), so the host moves half the bytes and never converts them. None otherwise.
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    teacher: torch.Tensor
    layer_ids: list[int]
    lengths: list[int] | None = None
    pad_to: int = 1  # T is a multiple of this (collate's pad_to_multiple_of; select keeps it)
    loss_mask: torch.Tensor | None = None  # None: every real token (as `mask`)
    held: torch.Tensor | None = None  # None: the teacher's states on every real token
    scale: torch.Tensor | None = None  # fp8 `teacher`: its float32 scales (dequantized by `to`)
    out_dtype: torch.dtype | None = None  # fp8 `teacher`: the dtype `to` dequantizes into
    segments: list[int] | None = None  # packed layout: the samples' lengths along the one row
    packing: Segments | None = None  # packed layout, on the device (`to`): positions, offsets, ends

    @property
    def ends(self) -> torch.Tensor | None:
        """[1, N] bool, True on each sample's last token of a packed row (device batches); None:
        right-padded rows, where a row's last real token ends its sample."""
        return self.packing.ends if self.packing is not None else None

    @property
    def padded(self) -> bool:
        """False when some row is shorter than T (the model needs the attention mask)."""
        if self.lengths is not None:
            return any(n < self.mask.shape[1] for n in self.lengths)
        return not bool(self.mask.all())

    def to(self, device, non_blocking: bool = True, stream: torch.cuda.Stream | None = None) -> Batch:
        """This batch on `device`, padded. Copies from pinned host memory run asynchronously
        (`non_blocking`); the caching host allocator keeps a pinned buffer until its copy is done.

        `stream` (a CUDA device; the training loop passes one): the copies, and the padding or fp8
        dequantization that follows them, run on that stream, so they overlap the kernels already
        queued on the current stream (the previous step's) instead of waiting behind them; the
        current stream waits for them before anything it queues later reads the batch."""
        device = torch.device(device)
        if stream is None or device.type != "cuda":
            return self._moved(device, non_blocking)
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            out = self._moved(device, non_blocking)
        current.wait_stream(stream)
        for t in out.device_tensors():  # allocated on `stream`, read and freed on `current`
            t.record_stream(current)
        return out

    def device_tensors(self) -> list[torch.Tensor]:
        """Every tensor this batch holds (with its packing's), for `record_stream`."""
        ts = [self.input_ids, self.mask, self.teacher, self.loss_mask, self.held, self.scale]
        if self.packing is not None:
            p = self.packing
            ts += [p.position_ids, p.cu_seqlens, p.ends]
        return [t for t in ts if t is not None]

    def _moved(self, device: torch.device, non_blocking: bool) -> Batch:
        ids = self.input_ids.to(device, non_blocking=non_blocking)
        mask = self.mask.to(device, non_blocking=non_blocking)
        if self.lengths is None:
            teacher = self._upload(self.teacher, device, non_blocking)
        else:
            b, t = self.mask.shape
            rest = self.teacher.shape[1:]
            packed = self._upload(self.teacher, device, non_blocking)
            if packed.shape[0] == b * t:  # no padding at all
                teacher = packed.view(b, t, *rest)
            elif device.type == "cpu":  # row by row (no index tensor)
                teacher = torch.zeros((b, t, *rest), dtype=packed.dtype)
                off = 0
                for row, n in enumerate(self.lengths):
                    teacher[row, :n] = packed[off : off + n]
                    off += n
            else:  # one scatter kernel on the device
                pos = _positions(self.lengths, t)
                if self.teacher.is_pinned():
                    pos = pos.pin_memory()
                teacher = torch.zeros((b * t, *rest), dtype=packed.dtype, device=device)
                teacher.index_copy_(0, pos.to(device, non_blocking=non_blocking), packed)
                teacher = teacher.view(b, t, *rest)
        lm = self.loss_mask.to(device, non_blocking=non_blocking) if self.loss_mask is not None else None
        held = self.held.to(device, non_blocking=non_blocking) if self.held is not None else None
        packing = self.packing
        if self.segments is not None and (packing is None or packing.ends.device != device):
            packing = Segments.build(self.segments, device, pin=non_blocking and self.input_ids.is_pinned())
        return Batch(
            ids,
            mask,
            teacher,
            self.layer_ids,
            loss_mask=lm,
            held=held,
            segments=self.segments,
            packing=packing,
        )

    def _upload(self, teacher: torch.Tensor, device, non_blocking: bool) -> torch.Tensor:
        """`teacher` on `device`; fp8 values are dequantized there with their scales."""
        moved = teacher.to(device, non_blocking=non_blocking)
        if self.scale is None:
            return moved
        scale = self.scale.to(device, non_blocking=non_blocking)
        return fp8.dequantize(moved, scale, self.out_dtype or torch.bfloat16)


def _positions(lengths: list[int], t: int) -> torch.Tensor:
    """Flat indices (row * t + column) of the real tokens of right-padded rows, in packed order."""
    lens = torch.tensor(lengths, dtype=torch.long)
    starts = torch.arange(len(lengths), dtype=torch.long) * t
    offsets = torch.cumsum(lens, 0) - lens  # packed start of each row
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    cols = torch.arange(int(lens.sum())) - offsets[rows]
    return starts[rows] + cols


def padded_length(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple` (GPU kernels such as cuDNN attention build a plan
    per shape: fewer distinct lengths, fewer plans)."""
    return -(-n // multiple) * multiple if multiple > 1 else n


def layer_index(sample: Sample, layer_ids: list[int]) -> list[int]:
    """Positions in `sample.layers` of each wanted teacher layer id.

    Raises:
        StudentError: the sample does not carry a wanted layer.
    """
    have = list(sample.layers)
    missing = [i for i in layer_ids if i not in have]
    if missing:
        raise StudentError(
            f"the teacher sends layers {have} but the student needs teacher layer(s) {missing} "
            f"(layer_map, or the last layer for the KL term): add them to the teacher's layers or "
            f"change student.layer_map (sample {sample.key!r})"
        )
    return [have.index(i) for i in layer_ids]


def unused_layers_hint(sent: list[int], needed: list[int]) -> str | None:
    """One line naming the teacher layers a sample carries that this student never reads, or None.
    They cost nothing on the shared-memory path (the student copies only what it reads), but they
    are extracted by the teacher and travel over TCP and into spool files."""
    unused = [i for i in sent if i not in needed]
    if not unused:
        return None
    share = len(unused) / len(sent)
    return (
        f"the teacher sends layers {list(sent)}; this student reads {sorted(needed)} and never uses "
        f"{unused} ({share:.0%} of the hidden-state bytes over TCP and in spool files): if no other "
        f"student needs them, drop them from the teacher's layer_ids"
    )


def check_sample(sample: Sample, layer_ids: list[int], hidden_size: int, partial_ok: bool = True) -> None:
    """Raise StudentError when `sample` cannot feed this student (layers, shapes, hidden size;
    `partial_ok` False: a sample that holds some positions only, teacher.capture: loss_mask)."""
    hs = sample.tensors.get("hidden_states")
    ids = sample.tensors.get("token_ids")
    if hs is None or ids is None:
        raise StudentError(
            f"sample {sample.key!r} has tensors {sorted(sample.tensors)}; need 'hidden_states' and 'token_ids'"
        )
    pos = sample.positions
    if pos is not None and not partial_ok:
        raise StudentError(
            f"sample {sample.key!r} holds the states of {pos.shape[0]} of its {ids.shape[0]} tokens "
            "(teacher.capture: loss_mask), but the EAGLE-3 draft attends to every earlier position's "
            "states (the prompt's too): run the teacher with teacher.capture: all"
        )
    rows = ids.shape[0] if pos is None else pos.shape[0]
    if hs.dim() != 3 or ids.dim() != 1 or hs.shape[0] != rows:
        raise StudentError(
            f"sample {sample.key!r}: hidden_states {list(hs.shape)} and token_ids {list(ids.shape)} "
            "must be [T, n_layers, H] and [T] (R rows with R positions)"
        )
    lm = sample.tensors.get("loss_mask")
    if lm is not None and (lm.dim() != 1 or lm.shape[0] != ids.shape[0]):
        raise StudentError(
            f"sample {sample.key!r}: loss_mask {list(lm.shape)} must be [T] with T = {ids.shape[0]} tokens"
        )
    if sample.layers and len(sample.layers) != hs.shape[1]:
        raise StudentError(f"sample {sample.key!r}: {len(sample.layers)} layer ids for {hs.shape[1]} layers")
    if fp8.is_quantized(sample) and tuple(sample.tensors[fp8.SCALE_KEY].shape) != tuple(hs.shape[:2]):
        raise StudentError(
            f"sample {sample.key!r}: fp8 scales {list(sample.tensors[fp8.SCALE_KEY].shape)} for hidden states "
            f"{list(hs.shape)} (one per token and layer expected)"
        )
    layer_index(sample, layer_ids)
    if hs.shape[2] != hidden_size:
        raise StudentError(
            f"sample {sample.key!r} has teacher hidden size {hs.shape[2]}, the config says {hidden_size} "
            "(teacher_model / teacher_hidden_size): point the student at the teacher that is running"
        )


# A batch's teacher rows are copied by up to `threads` threads (one sample each) once they come to
# this many bytes; smaller ones on the calling thread. The copies release the GIL, and under
# `accelerate launch` (OMP_NUM_THREADS=1) PyTorch's own copy uses one thread.
PARALLEL_COLLATE_BYTES = 8 << 20
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="distill-collate")
        return _pools[threads]


def _new_pools_in_child() -> None:
    """A forked child has none of the parent's threads: a pool inherited with them would take the
    copies and never run them (collate would hang). The child makes its own."""
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_new_pools_in_child)


def _run_copies(copies: list[Callable[[], object]], nbytes: int, threads: int) -> None:
    if threads > 1 and len(copies) > 1 and nbytes >= PARALLEL_COLLATE_BYTES:
        for _ in _pool(threads).map(lambda c: c(), copies):  # (re-raises a copy's error here)
            pass
    else:
        for c in copies:
            c()


def collate(
    samples: list[Sample],
    layer_ids: list[int],
    pin_memory: bool = False,
    pad_to_multiple_of: int = 1,
    threads: int = 1,
    pack: bool = False,
) -> Batch:
    """Copy `samples` into one packed Batch: token ids and mask padded on the right to T (the
    longest sample, rounded up to `pad_to_multiple_of`), the selected teacher layers packed
    [N, n, H] in the dtype the teacher sent, read by index straight from each received view (no
    upcast, no zero-filled padding on the host). `pin_memory`: page-locked, for an asynchronous copy
    to a GPU (`Batch.to`). `threads`: the teacher rows of a batch of at least
    PARALLEL_COLLATE_BYTES are copied by that many threads, a sample each (`student.collate_threads`).
    `pack`: the packed layout instead (`Batch.segments`): token ids and mask [1, N], the samples one
    after another, no padding (`pad_to_multiple_of` is not used).
    The result owns its memory: the samples' views may die after this."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    quantized = [fp8.is_quantized(s) for s in samples]
    if any(quantized) and not all(quantized):  # teachers with different settings: the model dtype
        samples = [fp8.dequantize_sample(s) for s in samples]
        quantized = [False]
    if quantized[0]:
        return _collate_fp8(samples, layer_ids, pin_memory, pad_to_multiple_of, threads, pack)
    return collate_values(samples, layer_ids, pin_memory, pad_to_multiple_of, threads, pack)


def collate_values(
    samples: list[Sample],
    layer_ids: list[int],
    pin_memory: bool = False,
    pad_to_multiple_of: int = 1,
    threads: int = 1,
    pack: bool = False,
) -> Batch:
    """`collate` without the fp8 handling: the teacher rows copied in the dtype they have."""
    lengths = [s.num_tokens for s in samples]
    t_max = padded_length(max(lengths), pad_to_multiple_of)
    shape = (1, sum(lengths)) if pack else (len(samples), t_max)
    first = samples[0].tensors["hidden_states"]
    hidden, dtype = first.shape[-1], first.dtype
    input_ids = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.bool)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    partial = any(s.positions is not None for s in samples)
    held = torch.zeros(shape, dtype=torch.bool) if partial else None
    # one flat view each: a sample's tokens start at `off` (packed) or at its row (padded)
    ids_f, mask_f, lm_f = input_ids.view(-1), mask.view(-1), loss_mask.view(-1)
    held_f = held.view(-1) if held is not None else None
    teacher = torch.empty(sum(lengths), len(layer_ids), hidden, dtype=dtype, pin_memory=pin_memory)
    copies: list[Callable[[], object]] = []  # the teacher rows, a sample each (disjoint ranges)
    off = 0
    for b, s in enumerate(samples):
        n = lengths[b]
        at0 = off if pack else b * t_max
        hs = s.tensors["hidden_states"]
        pos = layer_index(s, layer_ids)
        ids_f[at0 : at0 + n] = s.tensors["token_ids"]  # copies
        mask_f[at0 : at0 + n] = True
        lm = s.tensors.get("loss_mask")
        lm_f[at0 : at0 + n] = True if lm is None else lm.bool()  # (shape checked by check_sample)
        at = s.positions
        dst = teacher[off : off + n]
        if at is None:
            copies.append(lambda dst=dst, hs=hs, pos=pos: copy_layers(dst, hs, pos))
            if held_f is not None:
                held_f[at0 : at0 + n] = True
        else:  # some positions only: their rows where they belong, 0 elsewhere (never read)
            copies.append(lambda dst=dst, hs=hs, pos=pos, at=at: _copy_positions(dst, hs, pos, at))
            held_f[at0 + at.long()] = True
        off += n
    _run_copies(copies, teacher.nbytes, threads)
    if pin_memory:
        input_ids, mask, loss_mask = input_ids.pin_memory(), mask.pin_memory(), loss_mask.pin_memory()
        held = held.pin_memory() if held is not None else None
    return Batch(
        input_ids,
        mask,
        teacher,
        list(layer_ids),
        [off] if pack else lengths,
        1 if pack else max(pad_to_multiple_of, 1),
        loss_mask=loss_mask,
        held=held,
        segments=lengths if pack else None,
    )


def _copy_positions(dst: torch.Tensor, hs: torch.Tensor, pos: list[int], at: torch.Tensor) -> None:
    """A sample that holds some positions only: its rows where they belong in `dst`, 0 elsewhere."""
    rows = torch.empty(hs.shape[0], len(pos), *dst.shape[2:], dtype=dst.dtype)
    copy_layers(rows, hs, pos)
    dst.zero_().index_copy_(0, at.long(), rows)


def _collate_fp8(
    samples: list[Sample],
    layer_ids: list[int],
    pin_memory: bool,
    pad_to_multiple_of: int,
    threads: int,
    pack: bool = False,
) -> Batch:
    """`collate` for fp8 samples: the float8 rows as bytes and their scales, both packed; the
    dequantization happens in `Batch.to` on the device."""
    as_bytes = []
    for s in samples:  # each sample's fp8 states and scales as a uint8 / float32 model-free sample
        t = dict(s.tensors)
        t["hidden_states"] = t["hidden_states"].view(torch.uint8)
        as_bytes.append(Sample(key=s.key, tensors=t, layers=s.layers, meta=s.meta))
    batch = collate_values(as_bytes, layer_ids, pin_memory, pad_to_multiple_of, threads, pack)
    scale = torch.empty(batch.teacher.shape[:2], dtype=torch.float32, pin_memory=pin_memory)
    off = 0
    for s, n in zip(samples, batch.segments or batch.lengths, strict=True):
        sc = s.tensors[fp8.SCALE_KEY].unsqueeze(-1)  # [R, L, 1]: copied like the states
        pos = layer_index(s, layer_ids)
        at = s.positions
        if at is None:
            copy_layers(scale[off : off + n].unsqueeze(-1), sc, pos)
        else:
            rows = torch.empty(sc.shape[0], len(layer_ids), 1, dtype=torch.float32)
            copy_layers(rows, sc, pos)
            scale[off : off + n].zero_().index_copy_(0, at.long(), rows.squeeze(-1))
        off += n
    batch.teacher = batch.teacher.view(fp8.FP8)
    batch.scale = scale
    batch.out_dtype = fp8.DTYPE_NAMES.get(
        str(samples[0].meta.get("hidden_dtype", "bfloat16")), torch.bfloat16
    )
    return batch


def copy_layers(dst: torch.Tensor, hs: torch.Tensor, pos: list[int]) -> None:
    """dst[:, j] = hs[:, pos[j]] (converting the dtype if they differ). Evenly spaced positions
    (every layer, one layer, [1, 3] of four, ...) are one strided copy; others one copy per layer.
    Both are ~1.5x faster than index_select into `out` on the CPU (18 samples of 490 x 4 x 2048
    bf16, two layers wanted: 13-16 ms against 19-26 ms)."""
    step = pos[1] - pos[0] if len(pos) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(pos[:-1], pos[1:], strict=True)):
        dst.copy_(hs[:, pos[0] : pos[-1] + 1 : step])
    else:
        for j, p in enumerate(pos):
            dst[:, j].copy_(hs[:, p])


def select(batch: Batch, keep: list[int]) -> Batch:
    """The samples `keep` of a host `batch` (rows of padded rows, samples of a packed row), trimmed
    as `collate` would: equal to collating those samples."""
    if batch.lengths is None:
        return _select_dense(batch, keep)
    packed = batch.segments is not None
    units = batch.segments if packed else batch.lengths  # tokens of each sample
    lengths = [units[i] for i in keep]
    rows = _token_rows(units, keep)
    pinned = batch.teacher.is_pinned()
    teacher, scale = _gather_states(batch, rows, sum(lengths), pinned)
    per_token = (batch.input_ids, batch.mask, batch.loss_mask, batch.held)
    if packed:  # the kept samples' tokens, one after another
        ids, mask, lm, held = (None if x is None else x.index_select(1, rows) for x in per_token)
    else:  # the kept rows, cut to the longest (rounded up as collate did)
        t = padded_length(max(lengths) if keep else 0, batch.pad_to)
        idx = torch.tensor(keep, dtype=torch.long)
        ids, mask, lm, held = (
            None if x is None else x.index_select(0, idx)[:, :t].contiguous() for x in per_token
        )
    if pinned:
        ids, mask, lm, held = (None if x is None else x.pin_memory() for x in (ids, mask, lm, held))
    return Batch(
        ids,
        mask,
        teacher,
        batch.layer_ids,
        [sum(lengths)] if packed else lengths,
        batch.pad_to,
        loss_mask=lm,
        held=held,
        scale=scale,
        out_dtype=batch.out_dtype,
        segments=lengths if packed else None,
    )


def _select_dense(batch: Batch, keep: list[int]) -> Batch:
    """`select` of a batch whose teacher states are [B, T, n, H] with padding (not from collate)."""
    if batch.scale is not None:
        raise ValueError("select: a padded fp8 batch is not made by collate")
    idx = torch.tensor(keep, dtype=torch.long)
    mask = batch.mask.index_select(0, idx)
    t = int(mask.sum(1).max()) if keep else 0

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.index_select(0, idx)[:, :t].contiguous()

    return Batch(
        rows(batch.input_ids),
        mask[:, :t].contiguous(),
        rows(batch.teacher),
        batch.layer_ids,
        loss_mask=rows(batch.loss_mask),
        held=rows(batch.held),
    )


def _token_rows(units: list[int], keep: list[int]) -> torch.Tensor:
    """Indices of the kept samples' tokens in a batch's token-major teacher states."""
    offsets = [0]
    for n in units:
        offsets.append(offsets[-1] + n)
    if not keep:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(offsets[i], offsets[i] + units[i]) for i in keep])


def _gather_states(
    batch: Batch, rows: torch.Tensor, n: int, pinned: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher states (and fp8 scales) of `rows`, into new (pinned) host tensors of n tokens."""
    src = batch.teacher.view(torch.uint8) if batch.scale is not None else batch.teacher  # fp8 as bytes
    teacher = torch.empty((n, *src.shape[1:]), dtype=src.dtype, pin_memory=pinned)
    scale = None
    if batch.scale is not None:
        scale = torch.empty((n, *batch.scale.shape[1:]), dtype=batch.scale.dtype, pin_memory=pinned)
    if n:
        torch.index_select(src, 0, rows, out=teacher)
        if scale is not None:
            torch.index_select(batch.scale, 0, rows, out=scale)
    if batch.scale is not None:
        teacher = teacher.view(batch.teacher.dtype)
    return teacher, scale


def key_hash(key: str) -> int:
    """A stable signed 64-bit hash of a sample key (the same on every rank and every run)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def agree(proposals: Sequence[Sequence[int]], taken: Sequence[Collection[int]] = ()) -> list[list[bool]]:
    """Which proposed keys each rank trains in this micro-step: the same answer on every rank.

    `proposals[r]` holds the key hashes of rank r's micro-batch, in order. A key is dropped when it
    is in one of the `taken` sets (trained in a completed step, or accepted earlier in this
    gradient accumulation) or was proposed before in this micro-step: by a lower rank, or earlier
    by the same rank. Returns keep[r][i].
    """
    seen: set[int] = set()
    out = []
    for props in proposals:
        row = []
        for h in props:
            ok = h not in seen and not any(h in t for t in taken)
            if ok:
                seen.add(h)
            row.append(ok)
        out.append(row)
    return out


def idle_wait_s(idle_flush_s: float, anyone_backlogged: bool) -> float:
    """How long a rank may wait for samples in this iteration.

    0 when some rank had a backlog in the previous iteration (a full micro-batch, or as many samples
    as its credit allows): take what has arrived and go, so that an idle rank never slows a rank
    with a backlog to one batch per idle_flush_s. Otherwise (samples trickle in, or none come)
    `idle_flush_s`: waiting costs nobody anything then, and batches fill instead of degrading to
    one-sample steps.
    """
    return 0.0 if anyone_backlogged else idle_flush_s


def empty_batch(layer_ids: list[int], hidden_size: int) -> Batch:
    """A one-token all-padding batch: lets a rank without data take part in a collective step."""
    return Batch(
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.bool),
        torch.zeros(1, 1, max(len(layer_ids), 1), hidden_size),
        list(layer_ids),
        loss_mask=torch.zeros(1, 1, dtype=torch.bool),
    )


class TokenBudgetBatcher:
    """Groups samples so that batch_size x longest sample <= max_tokens.

    With `window` 0 or 1, batches are cut in arrival order: `push` returns a full batch when the new
    sample does not fit (the sample then starts the next batch), `flush` returns whatever is pending.

    With `window` W > 1, up to W samples are held (`pending`) and a batch is taken from them by
    length: the oldest pending sample and, closest in length first, the others that fit the budget.
    `push` returns such a batch once W samples are held; `flush` takes one batch (possibly leaving
    samples pending for the next). The oldest sample is in every batch taken, so none waits for more
    than W / (batch size) batches, and padding shrinks: a batch holds samples of similar lengths.
    A sample longer than the budget forms a batch alone either way.

    `packed` (the packed layout, `student.batch_layout: packed`): the budget counts the samples'
    tokens (no padding), batches are cut in arrival order and `window` is not used.
    """

    def __init__(
        self, max_tokens: int, max_samples: int | None = None, window: int = 0, packed: bool = False
    ):
        self.max_tokens = max_tokens
        self.max_samples = max_samples
        self.packed = packed
        self.window = window if window > 1 and not packed else 0  # 0: arrival order
        self.pending: list[Sample] = []  # samples not yet in a batch, in arrival order
        self._longest = 0  # longest pending sample, in tokens (arrival order)
        self._total = 0  # pending tokens (arrival order)
        self.filled = False  # set by next_micro_batch: its last batch was full (a backlog)
        self.capped = 0  # batches next_micro_batch ended early because the credit was all held

    def _fits(self, n_tokens: int) -> bool:
        if not self.pending:
            return True
        if self.max_samples is not None and len(self.pending) >= self.max_samples:
            return False
        if self.packed:
            return self._total + n_tokens <= self.max_tokens
        return (len(self.pending) + 1) * max(self._longest, n_tokens) <= self.max_tokens

    def push(self, sample: Sample) -> list[Sample] | None:
        if self.window:
            self.pending.append(sample)
            return self._take() if len(self.pending) >= self.window else None
        n = sample.num_tokens
        ready = None
        if not self._fits(n):
            ready = self.flush()
        self.pending.append(sample)
        self._longest = max(self._longest, n)
        self._total += n
        return ready

    @property
    def full(self) -> bool:
        """True when the next batch is due: W samples held, or (arrival order) no further sample
        of any length can join the pending batch."""
        if not self.pending:
            return False
        if self.window:
            return len(self.pending) >= self.window
        if self.max_samples is not None and len(self.pending) >= self.max_samples:
            return True
        if self.packed:
            return self._total >= self.max_tokens
        return (len(self.pending) + 1) * self._longest > self.max_tokens

    def flush(self) -> list[Sample]:
        if self.window:
            return self._take()
        out, self.pending, self._longest, self._total = self.pending, [], 0, 0
        return out

    def _take(self) -> list[Sample]:
        """One batch from the held samples: the oldest, then the closest in length that fit."""
        if not self.pending:
            return []
        anchor = self.pending[0].num_tokens
        rest = sorted(
            range(1, len(self.pending)), key=lambda i: (abs(self.pending[i].num_tokens - anchor), i)
        )
        chosen, longest = [0], anchor
        for i in rest:
            if self.max_samples is not None and len(chosen) >= self.max_samples:
                break
            n = self.pending[i].num_tokens
            if (len(chosen) + 1) * max(longest, n) <= self.max_tokens:
                chosen.append(i)
                longest = max(longest, n)
        keep = set(chosen)
        out = [s for i, s in enumerate(self.pending) if i in keep]
        self.pending = [s for i, s in enumerate(self.pending) if i not in keep]
        return out


def next_micro_batch(
    source,
    batcher: TokenBudgetBatcher,
    idle_flush_s: float,
    held: int | Callable[[], int] = 0,
    credit: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[Sample]:
    """Fill one micro-batch from `source`; [] when nothing came within `idle_flush_s` (or at the end).

    Returns as soon as the batch is full, the source is draining/exhausted, no more can come (this
    rank holds `held` unacked samples besides the batch, and `credit` is the most the teacher lets it
    hold; a callable `held` is asked again at every check: another thread acks while this one
    fills), or no sample arrived for `idle_flush_s` seconds (a partial batch is better than a
    stalled collective step). With `idle_flush_s` 0 (see `idle_wait_s`) it never waits: it takes the
    samples that have already arrived, up to a full batch, and returns them (possibly none).
    `batcher.filled` says afterwards whether the batch was full (or no more could come): a backlog.
    `stop()` True: return what it has at the next check (within 0.2 s), waiting for no more.
    """
    batcher.filled = False

    def capped() -> bool:
        unacked = held() if callable(held) else held
        return credit is not None and unacked + len(batcher.pending) >= credit

    def done(batch: list[Sample], filled: bool) -> list[Sample]:
        batcher.filled = filled and bool(batch)
        return batch

    if idle_flush_s <= 0:
        while not batcher.full and not capped():
            s = source.get(timeout=0.0)
            if s is None:
                return done(batcher.flush(), False)
            ready = batcher.push(s)
            if ready:
                return done(ready, True)
        batcher.capped += not batcher.full
        return done(batcher.flush(), True)
    last = time.monotonic()
    while True:
        if batcher.full or capped():
            batcher.capped += not batcher.full
            return done(batcher.flush(), True)
        wait = idle_flush_s - (time.monotonic() - last)
        if wait <= 0 or (stop is not None and stop()):
            return done(batcher.flush(), False)
        s = source.get(timeout=min(wait, 0.05) if source.draining else min(wait, 0.2))
        if s is None:
            if source.exhausted or (source.draining and batcher.pending):
                return done(batcher.flush(), False)
            continue
        last = time.monotonic()
        ready = batcher.push(s)
        if ready:
            return done(ready, True)
