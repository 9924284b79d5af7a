"""One value computed in a fresh interpreter and again in a child it forks afterwards (tests of
what a forked child inherits: thread pools whose threads it does not have).

`in_a_forked_child(setup, expr)` runs `setup`, evaluates `expr` in the parent (so whatever it uses
exists there first), forks, evaluates `expr` in the child and reads the child's answer with a
bound: a child that hangs is killed and answers "no answer in 30 s", never a hung test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import json, os, select, signal, sys
{setup}
want = str({expr})
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        os.write(w, str({expr}).encode())
    finally:
        os._exit(0)
os.close(w)
ready, _, _ = select.select([r], [], [], 30)  # bounded: a hung child is a failure, not a hang
got = os.read(r, 256).decode() if ready else "no answer in 30 s"
if not ready:
    os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
print(json.dumps({{"want": want, "got": got, "modules": sorted(sys.modules)}}))
"""


def in_a_forked_child(setup: str, expr: str, env: dict | None = None) -> dict:
    """{"want": the parent's str(expr), "got": the child's (or "no answer in 30 s"), "modules":
    the parent's imported modules}."""
    script = _SCRIPT.format(setup=textwrap.dedent(setup), expr=expr)
    p = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
