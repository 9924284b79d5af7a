"""The student's user-facing errors (printed as one line, without a traceback)."""

from __future__ import annotations


class StudentError(RuntimeError):
    """A problem the user must fix (config vs. teacher mismatch, missing data); printed without traceback."""


class TeacherGoneError(StudentError):
    """No teacher was heard for transport.teacher_wait_s: the student stops (exit code 3)."""
