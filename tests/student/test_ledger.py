"""student.ledger: the ledger and the trained-key hashes stay small on a run of days, and the
ledger survives a checkpoint unchanged."""

from __future__ import annotations

import json
import tracemalloc

from distill.checkpoint_layout import LEDGER, read_ledger, write_ledger
from student.ledger import HashSet, Ledger


def test_ledger_round_trips_through_its_file_in_merge_order(tmp_path):
    led = Ledger()
    led.record(["a", "bé", "c"], 0, 1)
    led.merge(led.local)
    led.merge([["d", 1, 2], ("e", 3, 70000)])
    led.step, led.history = 3, [{"loss": 1.0}]
    led.record(["local-only"], 1, 4)  # not merged: not saved (every rank merges before a save)
    write_ledger(tmp_path, led.state_dict())
    state = json.loads((tmp_path / LEDGER).read_text())
    assert state == {
        "step": 3,
        "history": [{"loss": 1.0}],
        "trained": [["a", 0, 1], ["bé", 0, 1], ["c", 0, 1], ["d", 1, 2], ["e", 3, 70000]],
    }
    back = Ledger()
    back.load_state_dict(read_ledger(tmp_path))
    assert back.trained == state["trained"] and len(back) == 5 and back.step == 3
    assert back.keys() == {"a", "bé", "c", "d", "e"} and led.keys() == back.keys() | {"local-only"}
    write_ledger(tmp_path, Ledger().state_dict())
    assert read_ledger(tmp_path) == {"step": 0, "history": [], "trained": []}


def test_a_hundred_thousand_entries_take_a_few_megabytes():
    n = 100_000
    tracemalloc.start()
    try:
        led = Ledger()
        led.merge([f"row-{i:08d}", i % 8, i // 64] for i in range(n))
        after_ledger = tracemalloc.get_traced_memory()[0]
        hashes = HashSet(range(0, n * 7919, 7919))
        after_hashes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # a list of [key, rank, step] took ~180 bytes an entry and a set of ints ~78
    assert after_ledger / n < 48, after_ledger / n
    assert (after_hashes - after_ledger) / n < 24, (after_hashes - after_ledger) / n
    assert len(led) == n and len(hashes) == n and 7919 * 5 in hashes and 7919 * 5 + 1 not in hashes


def test_hash_set_is_a_set():
    h = HashSet([5, -3], fold=4)
    h |= {1, 2, 3, 4, 5}  # the fourth new one folds the recent ones into the sorted array
    h.update([6, 6])
    h.add(2**63 - 1)
    h.add(-(2**63))
    for x in (5, -3, 1, 2, 3, 4, 6, 2**63 - 1, -(2**63)):
        assert x in h
    assert 0 not in h and 7 not in h and len(h) == 9
