"""Every error distill/ raises to its callers, one type per fact: a config that cannot be used
(`ConfigError`), a message that does not follow the protocol (`ProtocolError`, counted by reason),
a spool file that is damaged (`SpoolFormatError`, `SpoolChecksumError`), a journal that cannot be
used (`JournalError`, `JournalBusy`), a transport that cannot go on (`TransportError`) and a teacher
gone for good (`TeacherGone`), bad input to distill-reconcile (`ReconcileError`)."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A condition the transport cannot recover from by itself (e.g. a protocol version mismatch)."""


class TeacherGone(TransportError):
    """No teacher was heard for transport.teacher_wait_s: the student gives up waiting.

    The one type for that fact from the Subscriber to the student's exit code (3): the student's
    loop re-raises it once every rank saved what it trained, with `trained` (the samples in its
    lineage's ledger) filled in."""

    def __init__(self, why: str, trained: int | None = None):
        super().__init__(why)
        self.why, self.trained = why, trained


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message says which key and why."""


class ProtocolError(ValueError):
    """A message that does not follow the protocol. `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class SpoolFormatError(ValueError):
    """A file that is not a well-formed safetensors file (header, dtypes, offsets)."""


class SpoolChecksumError(ValueError):
    """A spool file whose tensor bytes do not match the digest (xxh3-64 or CRC32) written with them."""


class JournalError(RuntimeError):
    """The journal cannot be read, repaired or locked; the message is one line naming the file."""


class JournalBusy(JournalError):
    """Another process holds the journal's lock (or the teacher's `<journal>.lock`)."""


class ReconcileError(Exception):
    """Bad input; the message says what to fix."""
