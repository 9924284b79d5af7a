"""Transport: teacher `Publisher` (ROUTER, binds; distill/publisher.py) and student `Subscriber`
(DEALER, connects; distill/subscriber.py). This module is the import surface and the conversation;
their parts are objects in student_sessions.py, students.py, bounds.py, spooler.py, deliveries.py,
teacher_sessions.py and sockets.py (distill/API.md).

No sample is dropped silently: a teacher sends a sample only against credit that a student granted
(bounded in samples and bytes), keeps it until the student acknowledges it, and redelivers it to
another student when the first stops heartbeating or says BYE. Each sample goes to one student at
a time. When the teacher's memory bound is reached, or no student is connected, samples go to the
spool (safetensors files) and are replayed when credit returns.

Conversation (all control records are one msgpack frame, typed in protocol.CONTROL_FIELDS)::

    student                         teacher
    HELLO{name, credits}      ->
                              <-    WELCOME{tid, shm: [path, nonce] | None}
    CREDIT{shm_ok}            ->                 (student ready; teacher may send)
    ACKED{keys}               ->                 (after a new WELCOME: acked earlier, not committed)
    COMMIT{keys}              ->                 (committed while this teacher was away)
                              <-    SAMPLE ...   (frames, or header + shm slot reference + stamp)
    ACK{tid, seqs, commit}    ->                 (after the optimizer step; returns credit)
    COMMIT{keys}              ->                 (a saved checkpoint covers them: journaled)
    HEARTBEAT                <->    HEARTBEAT    (every heartbeat_interval_s)
                              <-    DRAIN        (nothing waits: flush batches, checkpoint, commit)
                              <-    END          (the run is complete)
    BYE                       ->                 (clean leave; unacked samples redelivered at once;
                                                  also the answer to END: END arrived)
    any (unknown peer)        ->
                              <-    RESET        (student sends HELLO again)
    another protocol version  ->
                              <-    REFUSE{reason, version}

A student session that ends (BYE, heartbeat timeout) with acked keys it never committed: the
teacher writes them to its journal as lost and returns them from `Publisher.take_lost()`; the
producer generates them again (students that still know them skip them).

Threads: each side has one I/O thread that owns its ZeroMQ sockets; `submit` / `ack` hand work
to it through a queue and a wake-up pipe.
"""

from __future__ import annotations

from distill.errors import TeacherGone, TransportError
from distill.iothread import tune_malloc
from distill.publisher import Publisher, RingSlot
from distill.subscriber import Subscriber

__all__ = ["Publisher", "RingSlot", "Subscriber", "TeacherGone", "TransportError", "tune_malloc"]
