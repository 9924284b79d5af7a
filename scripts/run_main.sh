#!/usr/bin/env bash
# The main job on the built-in CPU default: set up, then run the end-to-end distillation demo.
#   bash scripts/run_main.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}
if [ -f scripts/e2e.py ]; then
  exec .venv/bin/python scripts/e2e.py "$@"
fi
# Until the end-to-end job lands: the transport demo (teacher -> 2 student processes, 4 paths).
exec .venv/bin/python benchmarks/transport.py --repeats 1 --total-mb 256
