#!/usr/bin/env bash
# Build (or reuse) the virtualenv of the peer system, spec-ptc from PyPI, used by
# `python -m benchmarks.run patterns --systems agentrt,spec-ptc` (benchmarks/peer.py).
#
#   bash .ci/peer-venv.sh          # prints the venv path on stdout, nothing else on success
#
# spec-ptc needs Python >= 3.12; this project's own venv may be older, hence a venv of its own.
# Besides spec-ptc it holds this project installed without its heavy dependencies (no torch),
# plus anyio and pydantic: the peer driver imports the benchmark's pattern tools from here.
# Idempotent: when the venv answers `import spec_ptc` and its package list is the one recorded
# after the last build, nothing is installed.
# Env: PEER_VENV (default <repo>/.venv-peer), PEER_PYTHON (an interpreter >= 3.12 to build it
# with; default: the first of python3.13, python3.12, pyenv's 3.12+ versions that runs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PEER_VENV:-$ROOT/.venv-peer}"
PEER_PIN="spec-ptc==0.1.1"
LIGHT_DEPS=(anyio pydantic)
STAMP="$VENV/.agentrt-peer-packages"
PY="$VENV/bin/python"

is_312() {  # runs, and is Python >= 3.12
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
    local candidate
    if [ -n "${PEER_PYTHON:-}" ]; then
        is_312 "$PEER_PYTHON" && { echo "$PEER_PYTHON"; return 0; }
        echo "peer-venv: PEER_PYTHON=$PEER_PYTHON is not a Python >= 3.12" >&2
        return 1
    fi
    for candidate in python3.13 python3.12; do
        if is_312 "$candidate"; then echo "$candidate"; return 0; fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for candidate in "$(pyenv root)"/versions/3.1[2-9]*/bin/python3; do
            if [ -x "$candidate" ] && is_312 "$candidate"; then echo "$candidate"; return 0; fi
        done
    fi
    return 1
}

pip_install() {  # quiet pip; its log only when it fails
    local log
    log="$(mktemp)"
    if ! "$PY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
        rm -f "$log"
        echo "peer-venv: pip install $* failed" >&2
        return 1
    fi
    rm -f "$log"
}

package_list() {
    echo "$PEER_PIN ${LIGHT_DEPS[*]}"
    "$PY" -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null | sort
}

if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(package_list)" = "$(cat "$STAMP")" ] \
        && "$PY" -c "import spec_ptc, agentrt.tools" >/dev/null 2>&1; then
    echo "$VENV"
    exit 0
fi

if [ ! -x "$PY" ]; then
    if ! BASE="$(find_python)"; then
        echo "peer-venv: spec-ptc needs Python >= 3.12 and none was found (tried python3.13," \
             "python3.12 and pyenv's versions). Install one (e.g. 'pyenv install 3.12') or set" \
             "PEER_PYTHON=/path/to/python3.12." >&2
        exit 3
    fi
    echo "peer-venv: building $VENV with $BASE" >&2
    "$BASE" -m venv "$VENV"
fi
pip_install "$PEER_PIN" "${LIGHT_DEPS[@]}"
pip_install --no-deps -e "$ROOT"
if ! "$PY" -c "import spec_ptc, agentrt.tools" >/dev/null 2>&1; then
    echo "peer-venv: 'import spec_ptc, agentrt.tools' fails in $VENV:" >&2
    "$PY" -c "import spec_ptc, agentrt.tools" 2>&1 | tail -5 >&2
    exit 1
fi
package_list >"$STAMP"
echo "$VENV"
