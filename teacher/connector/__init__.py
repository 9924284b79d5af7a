"""The vLLM plugin: `kv_connector_module_path="teacher.connector"`, `kv_connector="DistillHiddenStatesConnector"`.

`plugin.py` the KV connector (its docstring lists the hooks by side and what `kv_transfer_params`
say); `parts.py` its self-contained parts (per-request info, the sender thread's job, the pinned
staging pool, the layer permutation, the loss mask, the spool lock, the replay-keys file);
`staging.py` its gather, the staging bound and the pieces of a long sample, the copy threads'
chunked copies and digest.

The connector class is imported on first access (vLLM does `getattr(import_module(path), name)`):
parts.py and staging.py import no vLLM, and `distill-teacher` uses them before vLLM is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from teacher.connector.plugin import DistillHiddenStatesConnector

__all__ = ["DistillHiddenStatesConnector"]


def __getattr__(name: str):
    if name == "DistillHiddenStatesConnector":
        from teacher.connector.plugin import DistillHiddenStatesConnector

        return DistillHiddenStatesConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
