"""`distill-finish --kv-transfer-config '<JSON>'`: END for the students of a `vllm serve` teacher.

The connector's Publisher in a `vllm serve` teacher (teacher/vllm_serve.py) never sends END: a server
never knows that a run is complete. Once every request is in, stop the server (Ctrl-C or SIGTERM:
its connector gives students `drain_timeout_s` to ack what they hold and spools the rest), then
run this command with the same `--kv-transfer-config` JSON the server got (or only its
`kv_connector_extra_config`, or a file holding either). It binds the same endpoints with the same
journal (and so the same run id), replays what the server spooled until the students acked every
sample and committed it (students that checkpoint get DRAIN and commit at their drain
checkpoint), then sends END and exits once every student answered it (BYE; one whose session
ended in silence is waited for, and so is one the server's connector was serving when it stopped
(its flow file beside the journal) that has not come back yet; see teacher/run/serve.py
`send_end`). Students end by themselves.

Exit codes: 0 END sent, every sample committed; 1 END sent, but samples were lost (acked by a
student whose session ended before a checkpoint covered them: the journal's `!lost` records;
their requests must be sent again), or the publisher failed (no END); 2 usage or config error,
also the endpoint or the journal still in use (the server is still running); 3 no student progress
for `--student-wait-s` (the spool is kept; run the command again); 130 SIGINT/SIGTERM (what was in
flight is spooled).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from distill.errors import ConfigError, JournalError
from distill.journal import Journal
from teacher.config import ConnectorConfig
from teacher.run.preflight import check_endpoints_free
from teacher.run.serve import send_end
from teacher.run.state import Stop
from teacher.sizing import take_flow

log = logging.getLogger("distill.teacher")

EXIT_OK, EXIT_LOST, EXIT_CONFIG, EXIT_STUDENTS_GONE, EXIT_SIGNAL = 0, 1, 2, 3, 130


def say(line: str) -> None:
    print(f"distill-finish: {line}", file=sys.stderr, flush=True)


def connector_config(text: str) -> ConnectorConfig:
    """The connector's config from `--kv-transfer-config` (inline JSON or a file): vLLM's whole
    KVTransferConfig JSON or only its `kv_connector_extra_config`."""
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as e:
            raise ConfigError(f"--kv-transfer-config: cannot read {text!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--kv-transfer-config: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("--kv-transfer-config: a JSON object is expected")
    if "kv_connector" in data or "kv_connector_extra_config" in data:
        data = data.get("kv_connector_extra_config") or {}
    conn = ConnectorConfig.from_extra(data)
    if conn.mode != "stream":
        raise ConfigError('the connector\'s mode is "spool": no student was served, nothing to end')
    return conn


def finish(conn: ConnectorConfig, student_wait_s: float, progress_every_s: float, stop: Stop) -> int:
    from distill.transport import Publisher, TransportError

    base = conn.transport.teacher_id or f"{socket.gethostname()}-{os.getpid()}"
    transport = conn.transport.model_copy(update={"teacher_id": f"{base}-finish"})
    try:
        check_endpoints_free(transport)
    except ConfigError as e:
        say(f"error: {e}: stop the vllm serve teacher first, then run this again")
        return EXIT_CONFIG
    pub = Publisher(transport, conn.spool, journal=conn.journal, auto_end=False)
    try:
        pub.start()
    except TransportError as e:
        say(f"error: {e}: stop the vllm serve teacher first, then run this again")
        return EXIT_CONFIG
    # Taken once this Publisher holds the journal: a try that cannot start leaves it to the next.
    flow = take_flow(conn.journal) if conn.journal else None  # written by the server's connector
    if flow is not None:
        pub.expect_students(flow["student_names"])
    try:
        pub.close_input()
        return _serve(pub, transport, conn, student_wait_s, progress_every_s, stop)
    except TransportError as e:
        say(f"serving stopped: {e}; no END was sent; what is not committed stays in {conn.spool.dir}")
        return EXIT_LOST
    finally:
        pub.close()


def _serve(pub, transport, conn, student_wait_s, progress_every_s, stop) -> int:
    """Replay the spool until nothing waits, is in flight or is uncommitted, and a student is
    connected; then END."""
    t0 = last_progress = time.monotonic()
    last_print, marks = t0 - progress_every_s, None
    while True:
        time.sleep(0.2)
        if stop.requested:
            say(f"stopped by a signal; no END was sent; what is not committed stays in {conn.spool.dir}")
            return EXIT_SIGNAL
        pub.check()
        pub.take_lost()  # recorded in the journal; reported at the end
        st, now = pub.stats(), time.monotonic()
        new = (st["sent"], st["acked"], st["committed"], st["students"])
        if new != marks:
            marks, last_progress = new, now
        left = st["spool_files"] + st["pending"] + st["inflight"] + st["uncommitted"]
        if now - last_print >= progress_every_s:
            last_print = now
            say(
                f"serving the spool: {st['spool_files'] + st['pending']} waiting, {st['inflight']} in flight, "
                f"{st['uncommitted']} acked not committed, {st['committed']} committed, "
                f"students {st['students']}"
            )
        if left == 0 and st["students"]:  # END to the students connected now and within a linger
            break
        if student_wait_s and now - last_progress > student_wait_s:
            say(
                f"no student progress for {student_wait_s:.0f}s: {left} samples not committed (in the "
                f"spool {conn.spool.dir}); no END was sent. Run this command again with students"
            )
            return EXIT_STUDENTS_GONE
    send_end(pub, transport, stop)
    lost = _lost_keys(conn.journal)
    st = pub.stats()
    if lost:
        shown = ", ".join(sorted(lost)[:10]) + (", ..." if len(lost) > 10 else "")
        say(
            f"END sent after {time.monotonic() - t0:.1f}s ({st['committed']} samples committed here), "
            f"but {len(lost)} samples were lost (acked by a student whose session ended before a "
            f"checkpoint covered them; journal {conn.journal}): send their requests again: {shown}"
        )
        return EXIT_LOST
    say(f"END sent after {time.monotonic() - t0:.1f}s; {st['committed']} samples committed here")
    return EXIT_OK


def _lost_keys(journal: str | None) -> set[str]:
    if not journal:
        return set()
    try:
        return Journal.read(journal).lost
    except JournalError as e:
        log.warning("%s", e)
        return set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distill-finish", description=__doc__.split("\n")[0])
    p.add_argument(
        "--kv-transfer-config",
        required=True,
        help="the vllm serve teacher's --kv-transfer-config JSON (or its kv_connector_extra_config, or a file)",
    )
    p.add_argument(
        "--student-wait-s",
        type=float,
        default=600.0,
        help="exit 3 after this long without student progress (0: never)",
    )
    p.add_argument("--progress-every-s", type=float, default=5.0, help="a progress line this often")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        conn = connector_config(args.kv_transfer_config)
    except ConfigError as e:
        say(f"error: {e}")
        return EXIT_CONFIG
    stop = Stop()
    old_int = signal.signal(signal.SIGINT, stop)
    old_term = signal.signal(signal.SIGTERM, stop)
    try:
        return finish(conn, args.student_wait_s, args.progress_every_s, stop)
    except KeyboardInterrupt:
        return EXIT_SIGNAL
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


if __name__ == "__main__":
    sys.exit(main())
