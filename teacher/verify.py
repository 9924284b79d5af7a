"""The live correctness probe (`teacher.verify_every: N`): delivered samples checked against transformers.

Design (why it looks like this): the samples leave from vLLM's worker process, and a streamed
sample is gone once a student acked it, so the check cannot read it back from the spool or the
journal. Instead `distill-teacher` marks every N-th request it submits (`kv_transfer_params.verify`)
and remembers the prompt token ids it sent. The connector's sender thread (in the worker, after the
rows are off the cache: never on the engine step) writes a copy of exactly what it delivers for a
marked request (tensors, layer labels) to `<journal>.verify/`, then places the sample as usual.
A thread in `distill-teacher` (this module) picks the copies up, recomputes the hidden states with
transformers from the delivered token ids on `teacher.verify_device`, and compares:

- the token ids: the delivered ids start with the prompt ids that were submitted (and are exactly
  them without `include_output_tokens`);
- every delivered layer, by its label: slot i against transformers' state of layer `layers[i]`
  (id 0 = embeddings, k = `hidden_states[k]`, L = the last decoder layer's output before the norm),
  as max |delivered - reference| / max |reference| per layer, against a dtype-aware tolerance
  (`teacher.verify_tol`; float32 1e-3, float16 2e-2, bfloat16 5e-2; with `teacher.hidden_dtype:
  fp8` each plus 1/16, the quantization's bound).

A mismatch is counted, logged with the key and the worst layer, and listed in the summary JSON
(`verify`); with `verify_fail: stop` generation stops after the current window and the run exits 5
(no END is sent). The copy is removed once checked. The reference model lives in this process
(CPU by default: it must not take the GPU memory vLLM was given).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import torch

from distill.fp8 import ERROR_BOUND
from distill.spool import list_spool, read_spool_file, remove_spool_file
from teacher.reference import ReferenceStates

log = logging.getLogger("distill.teacher.verify")

DEFAULT_TOL = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Verifier:
    """Checks the connector's copies of probed samples; thread-safe `expect` / `stats`."""

    def __init__(
        self,
        model: str,
        directory: Path,
        dtype: str,
        *,
        tol: float | None,
        fp8: bool = False,
        device: str = "cpu",
        fail: str = "warn",
        include_output_tokens: bool = False,
        every: int = 1,
    ):
        self.model_dir = model
        self.every = every  # offer(): every N-th submitted sample is probed
        self._offered = 0
        self.dir = Path(directory)
        self.dtype = dtype  # float32 / float16 / bfloat16 (auto resolved by the caller)
        # fp8 hidden states (distill/fp8.py) add at most 1/16 of each row's largest value.
        self.tol = tol if tol is not None else DEFAULT_TOL[dtype] + (ERROR_BOUND if fp8 else 0.0)
        self.device = device
        self.fail = fail
        self.include_output_tokens = include_output_tokens
        self._expected: dict[str, list[int]] = {}  # key -> prompt ids submitted, awaiting its copy
        self._lock = threading.Lock()
        self._ref = None  # teacher.reference.ReferenceStates, loaded at the first check
        self.probed = 0
        self.mismatches = 0
        self.mismatched: list[dict] = []  # first 20
        self.worst: dict | None = None  # the largest relative error seen (any sample)
        self.errors = 0  # copies that could not be checked (unreadable, unexpected)
        self.failed = threading.Event()  # a mismatch with fail=stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Stale copies of an earlier run: their prompt ids are not known here.
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in list_spool(self.dir):
            _remove(p)

    # -- producer side (the cli's prepare, any thread) ---------------------------------------
    def offer(self, key: str, ids: list[int]) -> bool:
        """A sample about to be submitted to vLLM: True (and expected) for every `every`-th, the
        first included, counted over the whole run."""
        n, self._offered = self._offered, self._offered + 1
        if n % self.every:
            return False
        self.expect(key, ids)
        return True

    def expect(self, key: str, ids: list[int]) -> None:
        with self._lock:
            self._expected[key] = list(ids)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="distill-verify", daemon=True)
            self._thread.start()

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.check_pending():
                self._stop.wait(0.5)

    def check_pending(self) -> int:
        """Check every copy now in the folder; returns how many were checked."""
        n = 0
        for p in list_spool(self.dir):
            try:
                self._check_file(p)
            except Exception as e:  # never kill the run for a probe that could not run
                self.errors += 1
                log.warning("verify: cannot check %s: %s: %s", p.name, type(e).__name__, e)
            finally:
                _remove(p)
            n += 1
        return n

    def drain(self, timeout_s: float = 600.0) -> None:
        """After the engine shut down (every copy written): check what is left, stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self.check_pending()

    # -- checking ----------------------------------------------------------------------------
    def _load(self) -> ReferenceStates:
        if self._ref is None:
            from transformers import AutoModelForCausalLM

            t = time.monotonic()
            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=_DTYPES[self.dtype])
            self._ref = ReferenceStates(m.to(self.device).eval())
            log.info("verify: reference model loaded on %s in %.1fs", self.device, time.monotonic() - t)
        return self._ref

    def reference(self, ids: list[int], layers: list[int]) -> torch.Tensor:
        """[T, len(layers), H] transformers' states of `layers` (L = before the final norm)."""
        ref = self._load()
        return ref.states(torch.tensor([ids], device=self.device), layers).float().cpu()

    def _check_file(self, path: Path) -> None:
        s = read_spool_file(path)
        with self._lock:
            want = self._expected.pop(s.key, None)
        if want is None:
            raise ValueError(f"no prompt ids recorded for {s.key!r}")
        got_ids = [int(x) for x in s.tensors["token_ids"].tolist()]
        hs = s.tensors["hidden_states"].float()
        self.probed += 1
        problem = None
        rel_worst, layer_worst = 0.0, None
        if got_ids[: len(want)] != want or (not self.include_output_tokens and len(got_ids) != len(want)):
            pos = next(
                (i for i, (a, b) in enumerate(zip(got_ids, want, strict=False)) if a != b),
                min(len(got_ids), len(want)),
            )
            problem = (
                f"token ids differ from the prompt at position {pos} ({len(got_ids)} vs {len(want)} ids)"
            )
        else:
            ref = self.reference(got_ids, list(s.layers))
            if s.positions is not None:  # teacher.capture: loss_mask: the rows of those positions
                ref = ref[s.positions.long()]
            if tuple(ref.shape) != tuple(hs.shape):
                problem = f"shape {tuple(hs.shape)} != reference {tuple(ref.shape)}"
            else:
                for i, layer in enumerate(s.layers):
                    d = (hs[:, i] - ref[:, i]).abs().max().item()
                    rel = d / max(ref[:, i].abs().max().item(), 1e-6)
                    if rel > rel_worst or layer_worst is None:
                        rel_worst, layer_worst = rel, int(layer)
                if rel_worst > self.tol:
                    problem = (
                        f"worst layer {layer_worst}: relative error {rel_worst:.3g} > tolerance {self.tol:g}"
                    )
        if self.worst is None or rel_worst > self.worst["rel_err"]:
            self.worst = {"key": s.key, "layer": layer_worst, "rel_err": rel_worst}
        if problem is None:
            return
        self.mismatches += 1
        if len(self.mismatched) < 20:
            self.mismatched.append(
                {"key": s.key, "layer": layer_worst, "rel_err": rel_worst, "problem": problem}
            )
        print(f"distill-teacher: verify mismatch: {s.key!r}: {problem}", file=sys.stderr, flush=True)
        if self.fail == "stop":
            self.failed.set()

    def summary(self) -> dict:
        with self._lock:
            unchecked = len(self._expected)
        return {
            "tolerance": self.tol,
            "device": self.device,
            "probed": self.probed,
            "mismatches": self.mismatches,
            "mismatched": self.mismatched,
            "worst": self.worst,
            "errors": self.errors,
            "unchecked": unchecked,  # marked, but no copy arrived (engine died, run stopped)
        }


def _remove(p: Path) -> None:
    remove_spool_file(p)
