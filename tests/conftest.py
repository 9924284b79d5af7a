"""Shared fixtures.

free_port      a function: a free tcp port on 127.0.0.1 (or on the address given)
procs          tests/faults.Procs for this test: every process it starts, and every descendant,
               is killed at teardown (also the torch elastic ranks a dead launcher orphans)
tiny_teacher   a tiny random Qwen3 teacher (hidden 128, 4 layers, vocab 1024), built once per session
netns_hosts    a function: netns_hosts(["t", "s0"]) -> tests/faults.Hosts (network namespaces on one
               bridge); skips the test, with the reason, where namespaces cannot be made; at teardown
               every process of `procs` is killed first, then the namespaces are deleted
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/faults.py, tests/waiting.py

import faults  # noqa: E402


@pytest.fixture
def free_port():
    return faults.free_port


@pytest.fixture
def procs(tmp_path):
    p = faults.Procs(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()
        left = p.leftovers()
        assert not left, f"processes survived the clean-up: {[x.pid for x in left]}"


@pytest.fixture
def netns_hosts(procs):
    made: list[faults.Hosts] = []

    def make(names: list[str]) -> faults.Hosts:
        why = faults.netns_available()
        if why:
            pytest.skip(f"needs network namespaces as hosts: {why}")
        h = faults.Hosts(names)
        made.append(h)
        return h

    try:
        yield make
    finally:
        procs.kill_all()  # nothing may stay inside a namespace that is deleted
        for h in made:
            h.close()


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    from distill.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_teacher") / "teacher",
        hidden_size=128,
        num_layers=4,
        vocab_size=1024,
        seed=0,
    )
