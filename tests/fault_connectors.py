"""Faulty subclasses of the teacher's connector, for tests only: `teacher.engine_args` names one
(`kv_transfer_config: {kv_connector: FlipConnector, kv_connector_module_path: fault_connectors}`,
with tests/ on the engine's PYTHONPATH). The live probe (`teacher.verify_every`) must catch both.

FlipConnector      adds 1 to the first value of every sample it sends (after hashing: the
                   Publisher hashes the changed bytes, so only the probe can tell)
MislabelConnector  delivers the cache's ascending layer order under the configured labels
FailPlaceConnector its sender thread fails to place every sample (neither streamed nor spooled),
                   as a full or broken spool disk and a closed Publisher would
FailLastConnector  places the samples before the FAIL_PLACE_FROM-th (default 4) of the engine's
                   life; from that one on, each waits until vLLM shuts the connector down (no
                   engine step is left to surface an error), then fails to be placed
"""

from __future__ import annotations

import os
import threading

from distill import fp8
from teacher.connector import DistillHiddenStatesConnector


class FlipConnector(DistillHiddenStatesConnector):
    def outgoing(self, tensors):
        key = fp8.SCALE_KEY if fp8.SCALE_KEY in tensors else "hidden_states"
        flipped = tensors[key].clone()  # an inference tensor: no in-place update
        flipped.view(-1)[0] += 1.0
        return {**tensors, key: flipped}


class MislabelConnector(DistillHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._perm = None  # the configured order is [4, 0, 2]: delivered as cached, [0, 2, 4]


class FailPlaceConnector(DistillHiddenStatesConnector):
    def _place(self, job):
        raise OSError(28, "injected: no space left to place the sample")


class FailLastConnector(DistillHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._shutting_down = threading.Event()
        self._n = 0
        self._first_failing = int(os.environ.get("FAIL_PLACE_FROM", "4"))

    def _place(self, job):
        self._n += 1  # (the sender thread only)
        if self._n < self._first_failing:
            return super()._place(job)
        if not self._shutting_down.wait(120):
            raise RuntimeError("FailLastConnector: vLLM did not shut the connector down in 120 s")
        raise OSError(5, "injected: the last sample could not be placed")

    def shutdown(self):
        self._shutting_down.set()  # before the sender thread is joined
        return super().shutdown()
