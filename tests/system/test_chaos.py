"""Seeded chaos (tests/chaos.py): for each seed, a random schedule of SIGKILL / SIGSTOP faults against
`distill-teacher`, vLLM's engine core and the two ranks of a real `accelerate launch` student job,
restarts as README.md tells a user, and at the end, from the processes' own records: every key
trained exactly once (the final metrics.json of the student lineage), the teacher's journal and
summary.json complete (exit 0, committed == total), nothing left in the spool, no ring file, no
engine record, and every process ended by itself with a documented exit code.

Across hosts (network namespaces, tcp only) the schedule may also take the students' link down for a
while. CI runs conftest.CHAOS_CI_SEEDS and CHAOS_HOSTS_CI_SEEDS. Replay a failure: `pytest tests/system/test_chaos.py --chaos-seed S`
(or CHAOS_SEED=S); long runs: `--chaos-seeds N` (N random seeds, each in the test id). A failure
prints the seed, the schedule and what happened, with the log tails.
"""

from __future__ import annotations

import time

import chaos
import faults
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

N_ROWS = 64


def test_seeded_chaos(procs, tmp_path, tiny_teacher, chaos_seed):
    pytest.importorskip("vllm")
    sched = chaos.schedule(chaos_seed)
    run, expected = chaos.run_file(tmp_path, tiny_teacher, N_ROWS, faults.free_port())
    _run_schedule(chaos.Chaos(procs, tmp_path, run, expected), chaos_seed, sched, procs, "")


def test_seeded_chaos_across_hosts(procs, tmp_path, tiny_teacher, chaos_hosts_seed):
    """The teacher on one host, the two ranks on another (network namespaces on a bridge, each its
    own /dev/shm): the same rules, and the link between them may go down for a while."""
    pytest.importorskip("vllm")
    why = faults.netns_available()
    if why:
        pytest.skip(why)
    sched = chaos.schedule(chaos_hosts_seed, hosts=True)
    hosts = faults.Hosts(["t", "s"])
    try:
        run, expected = chaos.run_file(
            tmp_path, tiny_teacher, N_ROWS, faults.free_port(), teacher_addr=hosts.addr["t"]
        )
        c = chaos.Chaos(procs, tmp_path, run, expected, hosts=hosts)
        _run_schedule(c, chaos_hosts_seed, sched, procs, " (across hosts)")
    finally:
        procs.kill_all()  # a namespace goes only once nothing runs in it (after a failure)
        hosts.close()


def _run_schedule(c: chaos.Chaos, seed: int, sched: list, procs, where: str) -> None:
    t0 = time.monotonic()
    try:
        c.run(sched)
        result = c.check()
    except AssertionError as e:
        tails = "\n".join(f"--- {p.name} (exit {p.poll()}):\n{p.tail(1500)}" for p in procs.procs[-3:])
        raise AssertionError(
            f"CHAOS{where} {chaos.describe(seed, sched)}\n"
            f"replay: pytest tests/system/test_chaos.py --chaos-seed {seed}\n"
            "events:\n  " + "\n  ".join(c.events) + f"\n{e}\n{tails}"
        ) from None
    print(f"CHAOS{where} {chaos.describe(seed, sched)}: {result['line']} ({time.monotonic() - t0:.0f} s)")
    print("  " + "\n  ".join(c.events))
