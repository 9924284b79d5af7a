"""The student's user-facing errors (printed as one line, without a traceback)."""

from __future__ import annotations


class StudentError(RuntimeError):
    """A problem the user must fix (config vs. teacher mismatch, missing data); printed without traceback.
    `reason`: the token metrics.json's `exit_reason` carries."""

    reason = "error"


class CheckpointError(StudentError):
    """A checkpoint could not be written (a full disk): nothing of it is kept, every rank stops."""

    def __init__(self, message: str, disk_full: bool = True):
        super().__init__(message)
        self.reason = "checkpoint_disk_full" if disk_full else "checkpoint_failed"


class TeacherGoneError(StudentError):
    """No teacher was heard for transport.teacher_wait_s: the student stops (exit code 3)."""
