"""Online mode: `python -m teacher.serve serve ...` (vLLM's OpenAI server) with the connector."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm")

import faults  # noqa: E402

from distill.config import TransportConfig  # noqa: E402
from distill.tiny import build_tiny_model  # noqa: E402
from distill.transport import Subscriber  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_vllm_serve_streams_requests_to_a_student(tmp_path):
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "tiny")
    http, zport = faults.free_port(), faults.free_port()
    ep = f"tcp://127.0.0.1:{zport}"
    extra = {
        "transport": {"bind": [ep], "connect_timeout_s": 120},
        "spool": {"dir": str(tmp_path / "spool")},
        "journal": str(tmp_path / "journal.txt"),
    }
    cmd = [
        sys.executable, "-m", "teacher.serve", "serve", str(model), "--port", str(http),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--no-enable-chunked-prefill",
        "--speculative-config", json.dumps({
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 4]}},
        }),
        "--kv-transfer-config", json.dumps({
            "kv_connector": "DistillHiddenStatesConnector", "kv_connector_module_path": "teacher.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": extra,
        }),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "server.log", "w")  # a file, not a pipe: vLLM logs a lot
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    sub = Subscriber(TransportConfig(connect=[ep], shm="off", heartbeat_timeout_s=30)).start()
    engines: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        engines = psutil.Process(server.pid).children(recursive=True)  # vLLM's EngineCore
        text = "the teacher streams hidden states to the student"
        resp = _post(
            f"http://127.0.0.1:{http}/v1/completions",
            {
                "model": str(model),
                "prompt": text,
                "max_tokens": 1,
                "kv_transfer_params": {"sample_key": "online-1", "meta": {"src": "api"}},
            },
        )
        kv = resp["kv_transfer_params"]
        assert kv["sample_key"] == "online-1" and kv["destination"] == "stream"
        s = sub.get(timeout=60)
        assert s is not None and s.key == "online-1" and s.meta["src"] == "api" and s.layers == [1, 4]
        ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
        assert s.tensors["token_ids"].tolist() == ids
        assert tuple(s.tensors["hidden_states"].shape) == (len(ids), 2, 128)
        sub.ack(s)
        journal = tmp_path / "journal.txt"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (journal.exists() and "online-1" in journal.read_text()):
            time.sleep(0.2)
        assert "online-1" in journal.read_text()  # the ack reached the teacher
    finally:
        sub.close()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        # An EngineCore that outlives its server would hold memory and cores under the next test.
        for proc in engines:
            with contextlib.suppress(psutil.Error):
                proc.wait(timeout=30)
            with contextlib.suppress(psutil.Error):
                proc.kill()
        log.close()
