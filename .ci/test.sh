#!/usr/bin/env bash
# The test suite: set-up (idempotent), then the default tests (slow and vllm tests excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
exec .venv/bin/python -m pytest -q "$@"
