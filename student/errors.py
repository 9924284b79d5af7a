"""The student's user-facing errors (printed as one line, without a traceback). A teacher that is
gone is the transport's `distill.errors.TeacherGone`, raised as it is up to the exit code."""

from __future__ import annotations


class StudentError(RuntimeError):
    """A problem the user must fix (config vs. teacher mismatch, missing data); printed without traceback.
    `reason`: the token metrics.json's `exit_reason` carries."""

    reason = "error"


class CheckpointError(StudentError):
    """A checkpoint (or the final model) could not be written, e.g. a full disk: nothing of it is
    kept, every rank stops with the same line. `reason`: checkpoint_disk_full, checkpoint_failed,
    output_disk_full or output_failed."""

    def __init__(self, message: str, reason: str = "checkpoint_disk_full"):
        super().__init__(message)
        self.reason = reason
