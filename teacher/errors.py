"""Every error teacher/ raises between its parts, one type per fact: the engine died
(`EngineDied`: distill-teacher exits 1), the serve phase cannot go on (`ServeFailed`), a spool
that distill-export cannot convert (`ExportError`: one line, exit 2), a JSON row that names a field
twice (`DuplicateField`). Configuration errors are distill's `ConfigError` (distill/errors.py)."""

from __future__ import annotations


class EngineDied(Exception):
    """The vLLM engine failed (start or mid-run): exit 1, never END."""


class ServeFailed(Exception):
    """The serve phase could not start its Publisher, or its I/O thread failed while serving (or
    the generate phase could not bind its endpoints, or its connector placed none of its samples):
    exit 1, the spool intact."""


class ExportError(ValueError):
    """Input the export cannot use; the message is one line that says what to do."""


class DuplicateField(ValueError):
    """A JSON object names the same field twice (plain json.loads keeps the last one silently)."""

    def __init__(self, name: str):
        super().__init__(f"field {name!r} appears twice in one JSON object")
        self.name = name
