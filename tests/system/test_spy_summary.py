"""benchmarks/benchlib/spy.py's summary of py-spy's raw stacks (no processes): the training loop's
time by Trainer step, its waits for the collate threads and for samples, and each other thread's
busy share (pool threads counted together, blocked frames not busy)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("spy_bench", ROOT / "benchmarks" / "benchlib" / "spy.py")
spy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spy)

PROC = 'process 7:"python student.py --config run.yaml"'
MAIN = "thread (7): MainThread;<module> (student.py:1);Trainer.run (student/loop.py:190)"


def line(thread: str, frames: list[str], n: int) -> str:
    return ";".join([PROC, thread, *(f"{f} (x.py:{i})" for i, f in enumerate(frames))]) + f" {n}\n"


def test_summary_of_raw_stacks(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "".join(
            [
                MAIN.replace("Trainer.run (student/loop.py:190)", "main (student.py:9)") + " 7\n",  # start-up
                line(
                    MAIN,
                    ["Trainer.fill", "collate", "_result_or_cancel", "Future.result", "Condition.wait"],
                    30,
                ),
                line(
                    MAIN,
                    ["Trainer.fill", "next_micro_batch", "Deliveries.next", "Queue.get", "Condition.wait"],
                    20,
                ),
                line(MAIN, ["Trainer.forward_backward", "Tensor.backward", "_engine_run_backward"], 40),
                line(MAIN, ["Trainer.optimizer_step", "Adam.step"], 10),
                line("thread (8): distill-subscriber", ["Thread.run", "Subscriber._run", "x3t_of"], 60),
                line("thread (8): distill-subscriber", ["Thread.run", "Subscriber._run", "Poller.poll"], 40),
                line("thread (9): distill-collate_0", ["Thread.run", "_worker", "copy_layers"], 10),
                line("thread (9): distill-collate_0", ["Thread.run", "_worker"], 90),
                line("thread (10): distill-collate_1", ["Thread.run", "_worker", "copy_layers"], 30),
                line("thread (10): distill-collate_1", ["Thread.run", "_worker"], 70),
                "not a stack line\n",
            ]
        )
    )
    s = spy.summarize(raw)
    assert s["loop_s"] == 1.0  # 100 samples in the loop at 100 Hz; start-up not counted
    assert s["loop_share"] == {
        "Trainer.fill": 0.5,
        "Trainer.forward_backward": 0.4,
        "Trainer.optimizer_step": 0.1,
    }
    assert s["loop_waits"] == {"collate threads": 0.3, "samples": 0.2}
    assert s["loop_top"][:2] == [
        ["_engine_run_backward <- Tensor.backward <- Trainer.forward_backward", 0.4],
        ["Condition.wait <- Future.result <- _result_or_cancel", 0.3],
    ]
    assert s["threads"]["distill-subscriber"]["busy"] == 0.6
    assert s["threads"]["distill-subscriber"]["top"] == [["x3t_of <- Subscriber._run", 0.6]]
    assert (
        s["threads"]["distill-collate"]["samples"] == 200 and s["threads"]["distill-collate"]["busy"] == 0.2
    )
    assert "MainThread" not in s["threads"]


def test_a_file_without_the_loop_says_so(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(line("thread (8): distill-subscriber", ["Poller.poll"], 5))
    assert spy.summarize(raw) == {"error": "no samples inside Trainer.run in spy.txt"}
