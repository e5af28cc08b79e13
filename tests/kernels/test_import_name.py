"""The kernels/ folder is agentrt.kernels: from the source tree's root, where ``python -m`` puts
the root on sys.path, a top-level ``import kernels`` gets the PyPI package of that name where it
is installed (transformers imports it), and this folder where it is not (transformers then finds
no version and leaves it alone; the vLLM suite runs that way)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, json, sys
sys.path.insert(0, "")
import kernels
top = kernels.__file__
import agentrt.kernels
print(json.dumps([top, agentrt.kernels.__file__, hasattr(agentrt.kernels, "greedy_verify")]))
"""


def test_top_level_kernels_from_the_source_root_is_not_this_folder():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    top, ours, has_api = json.loads(out)
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert (Path(top).resolve().parent != ROOT / "kernels") == installed
    assert Path(ours).resolve().parent == ROOT / "kernels" and has_api


def test_transformers_hub_kernels_imports_from_the_source_root():
    if importlib.util.find_spec("transformers") is None:
        return
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, ''); "
                    "import transformers.integrations.hub_kernels"], cwd=ROOT, check=True)
