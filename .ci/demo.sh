#!/usr/bin/env bash
# The main demo: set-up (idempotent), then an end-to-end agent run on the native engine with SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
exec .venv/bin/agentrt demo "$@"
