#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtualenv in .venv, torch 2.13.0 (CPU) first, agentrt with its
# dev extras, and the SmolLM2-135M-Instruct model converted into the local model cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# bubblewrap: the OS jail around the sandbox's worker processes (docs/sandbox.md).
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing bubblewrap ..."
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "warning: bubblewrap (bwrap) is not installed: the sandbox will refuse to start" >&2
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.agentrt-setup
want=$(sha256sum pyproject.toml | cut -c1-16)

pip_install() {  # quiet pip; its full log only when it fails
    local log
    log=$(mktemp)
    if ! "$VPY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setting up .venv (torch 2.13.0 CPU, agentrt[dev]) ..."
    pip_install --upgrade pip
    # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
    pip_install torch==2.13.0
    pip_install -e '.[dev]'
    "$VPY" -c 'import torch, agentrt; assert torch.__version__.startswith("2.13.0"), torch.__version__'
    echo "$want" > "$stamp"
fi
# The sandbox refuses to run model code without its OS jail: say now whether it can be built.
if ! "$VPY" -c 'from agentrt.interpreter import jail; jail.plan_jail(True)' 2>/tmp/agentrt-jail.$$; then
    echo "warning: $(tail -n 1 /tmp/agentrt-jail.$$)" >&2
fi
rm -f /tmp/agentrt-jail.$$
# The embedded default model (no-op when already pulled and valid).
.venv/bin/agentrt models pull smollm2-135m
