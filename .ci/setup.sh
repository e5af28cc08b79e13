#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtualenv in .venv, torch 2.13.0 (CPU) first, agentrt with its
# dev extras, and the SmolLM2-135M-Instruct model converted into the local model cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.agentrt-setup
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VPY" -m pip install -q --upgrade pip 2>&1 | grep -v -e '^WARNING: Location' || true
    # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
    "$VPY" -m pip install -q torch==2.13.0 2>&1 | grep -v -e '^WARNING: Location' || true
    "$VPY" -m pip install -q -e '.[dev]' 2>&1 | grep -v -e '^WARNING: Location' || true
    "$VPY" -c 'import torch, agentrt; assert torch.__version__.startswith("2.13.0"), torch.__version__'
    echo "$want" > "$stamp"
fi
# The embedded default model (no-op when already pulled and valid).
.venv/bin/agentrt models pull smollm2-135m
