"""The engine benchmark's systems by name: the default set of each ``--engine``, what each one
is (the Systems legend), and the roles some play (reference, speedup bases, the anchor)."""

from __future__ import annotations

from .common import VLLM_SYSTEMS

ENGINES = ("native", "vllm", "openai")
NATIVE_SYSTEMS = ("hf", "hf-lookup", "plain", "ngram", "suffix", "draft")
HEAD_SYSTEMS = ("eagle", "hybrid")
"""Native systems drafting with the learned head (`agentrt draft train`; not in any default set)."""
TWIN_SYSTEMS = ("twin", "hybrid-twin")
"""Native systems drafting with the target's own int8 twin (exact precision; not in any default
set)."""
INT8_SYSTEMS = ("plain-int8", "suffix-int8", "eagle-int8", "hybrid-int8")
"""Native systems in ``precision="int8"`` (not in any default set)."""
BF16_SYSTEMS = ("plain-bf16",)
"""Native systems in ``precision="bf16"`` (bf16 activations in steps of many rows; not in any
default set)."""
AVX2_SYSTEMS = ("plain-avx2",)
"""Native exact systems with every matmul kept on AVX2 (as ``AGENTRT_GEMM_ISA=avx2``: the same
bits, the speed of a CPU without AVX512; not in any default set)."""
LLAMACPP_SYSTEMS = ("llamacpp",)
ALL_SYSTEMS = (*NATIVE_SYSTEMS, *HEAD_SYSTEMS, *TWIN_SYSTEMS, *INT8_SYSTEMS, *BF16_SYSTEMS,
               *AVX2_SYSTEMS, *VLLM_SYSTEMS, *LLAMACPP_SYSTEMS, "openai")
DEFAULT_SYSTEMS = {
    "native": NATIVE_SYSTEMS,
    "vllm": ("plain", "vllm", "vllm-spec"),
    "openai": ("openai",),
}
DEFAULT_VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2}
SPEEDUP_BASES = ("plain", "hf", "hf-lookup", "vllm", "llamacpp")
REFERENCE_SYSTEMS = ("plain", "vllm")
DESCRIPTIONS = {
    "hf": "transformers generate, greedy",
    "hf-lookup": "transformers generate, prompt_lookup_num_tokens=10",
    "plain": "native, no drafter",
    "ngram": "native + n-gram prompt lookup",
    "suffix": "native + suffix automaton (cross-request corpus)",
    "draft": "native + layer-skip draft model",
    "vllm": "vLLM AsyncLLM in process, eager, no speculation",
    "vllm-spec": "vLLM AsyncLLM in process, eager, speculative_config",
    "openai": "OpenAIEngine (chat API)",
    "plain-int8": "native, no drafter, precision='int8' (int8 activations x GGUF blocks)",
    "plain-bf16": ("native, no drafter, precision='bf16' (bf16 activations on AVX512-BF16 in "
                   "steps of 64+ rows)"),
    "plain-avx2": "native, no drafter, exact, matmuls on AVX2 only (AGENTRT_GEMM_ISA=avx2)",
    "suffix-int8": "native + suffix automaton, precision='int8'",
    "eagle": "native + learned draft head (agentrt draft train)",
    "hybrid": "native + suffix lookup or learned head per step (expected tokens per second)",
    "twin": "native + the target's own int8 twin drafting in its KV blocks",
    "hybrid-twin": "native + suffix lookup or the int8 twin per step (expected tokens per second)",
    "eagle-int8": "native + learned draft head, precision='int8'",
    "hybrid-int8": "native + suffix lookup or learned head per step, precision='int8'",
    "llamacpp": "llama-cpp-python on the GGUF the model was pulled from, greedy, no speculation",
}
IN_PROCESS_SYSTEMS = ("openai",)
"""Systems that run in the benchmark's own process: their work happens in a server's."""
ANCHOR = "llamacpp"
"""The system every other one is compared with, checked for steadiness (`AnchorCheck`)."""
DEFAULT_ANCHOR_TOLERANCE = 0.10
LOOKUP_SYSTEMS = ("ngram", "suffix")
"""Native systems drafting by lookup, whose ceiling the tables show (`benchmarks.ceiling`)."""
