"""The speculative-decoding verification hot path: greedy and stochastic verify, sampling.

CUDA tensors run Triton kernels, everything else the torch reference (`dispatch` says which);
both make the same decisions for the same pre-drawn uniforms.
"""

from __future__ import annotations

_handed_over = False
if __name__ == "kernels":
    # Imported as top-level ``kernels``: ``python -m`` from the source tree's root puts the root on
    # sys.path, where this folder shadows the PyPI package ``kernels`` (which transformers
    # imports). Where that package is installed, such an import gets it; where it is not, this
    # folder answers as it always did.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
        _handed_over = True

if not _handed_over:
    from .dispatch import (
        backend_for,
        greedy_verify,
        probs_from_logits,
        sample,
        stochastic_verify,
        triton_available,
    )

    __all__ = ["probs_from_logits", "greedy_verify", "stochastic_verify", "sample",
               "triton_available", "backend_for"]
