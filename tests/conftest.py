"""Shared fixtures.

free_port      a function: a free tcp port on 127.0.0.1 (or on the address given)
procs          tests/faults.Procs for this test: every process it starts, and every descendant,
               is killed at teardown (also the torch elastic ranks a dead launcher orphans)
tiny_teacher   a tiny random Qwen3 teacher (hidden 128, 4 layers, vocab 1024), built once per session
netns_hosts    a function: netns_hosts(["t", "s0"]) -> tests/faults.Hosts (network namespaces on one
               bridge); skips the test, with the reason, where namespaces cannot be made; at teardown
               every process of `procs` is killed first, then the namespaces are deleted
chaos_seed     the seeds of tests/system/test_chaos.py: CHAOS_CI_SEEDS (across hosts: CHAOS_HOSTS_CI_SEEDS), or `--chaos-seed S` (repeatable; env
               CHAOS_SEED=S[,S2]) to replay a schedule, or `--chaos-seeds N` for N random seeds
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
# tests/faults.py, tests/waiting.py, ...; and the test folders, so that a test file can reuse another's
# helpers by module name (`from test_teacher_cli import _run`): basenames are unique across folders.
for _d in ("", "distill", "teacher", "student", "system"):
    if str(_HERE / _d) not in sys.path:
        sys.path.insert(0, str(_HERE / _d))

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
    from testkit.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_teacher") / "teacher",
        hidden_size=128,
        num_layers=4,
        vocab_size=1024,
        seed=0,
    )


# Seeded chaos (tests/system/test_chaos.py): which seeds run.
# With CHAOS_HOSTS_CI_SEEDS: every fault kind but a rank stopped (seed 64 has that one too; the
# frozen rank has its own row in tests/system/test_fault_matrix.py); one seed less keeps CI near 50 min.
CHAOS_CI_SEEDS = [52]
# across hosts: the students' link down 8.9 s, SIGSTOP 3.8 s of the teacher's tree, SIGKILL teacher@engine
CHAOS_HOSTS_CI_SEEDS = [148]


def pytest_addoption(parser):
    group = parser.getgroup("chaos", "seeded chaos (tests/system/test_chaos.py)")
    group.addoption(
        "--chaos-seed",
        type=int,
        action="append",
        default=[],
        help="replay this seed's fault schedule (repeatable; also env CHAOS_SEED)",
    )
    group.addoption(
        "--chaos-seeds",
        type=int,
        default=0,
        help="run N random seeds (each printed) instead of the CI seeds",
    )


def pytest_generate_tests(metafunc):
    names = [n for n in ("chaos_seed", "chaos_hosts_seed") if n in metafunc.fixturenames]
    if not names:
        return
    import os
    import random

    seeds = list(metafunc.config.getoption("chaos_seed"))
    if not seeds and os.environ.get("CHAOS_SEED"):
        seeds = [int(x) for x in os.environ["CHAOS_SEED"].split(",")]
    n = metafunc.config.getoption("chaos_seeds")
    if not seeds and n:
        rng = random.SystemRandom()
        seeds = [rng.randrange(1, 1_000_000) for _ in range(n)]
    ci = CHAOS_CI_SEEDS if names[0] == "chaos_seed" else CHAOS_HOSTS_CI_SEEDS
    metafunc.parametrize(names[0], seeds or ci, ids=lambda s: f"seed{s}")
