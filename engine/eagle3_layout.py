"""The EAGLE-3 draft-head directory: write it from a state dict, and check it against a target.

A head directory holds ``config.json`` (a one-layer Llama config with the EAGLE-3 fields) and
``model.safetensors`` (tensor names as EAGLE-3 checkpoints name them), exactly what vLLM's
``eagle3`` speculative method loads (``Eagle3LlamaForCausalLM``), so the same directory serves
the native engine and ``VLLMEngine(speculative_config={"method": "eagle3", "model": <dir>,
"num_speculative_tokens": k})``. There is no ``embed_tokens``: the head uses the target's
embedding, which is why its hidden size must equal the target's. ``d2t`` maps the reduced draft
vocabulary back (``target_id = draft_id + d2t[draft_id]``), ``t2d`` marks the target ids the
draft vocabulary holds.

`check_head` reads only the config and the safetensors header (plus ``d2t`` and ``t2d``) and
raises `HeadLayoutError` listing everything that would stop vLLM loading the head for that
target, or make it draft wrong tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .base import EngineError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class HeadLayoutError(EngineError, ValueError):
    """A head directory (or the tensors for one) does not fit the EAGLE-3 layout or its
    target; the message names every problem found."""

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{where}: " + "; ".join(problems))


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default feature layers for a target of ``num_layers``: low, middle, high."""
    return [2, num_layers // 2, num_layers - 3]


def target_config(target: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A target model's Hugging Face config: a mapping as is, or a model directory's
    ``config.json``."""
    if isinstance(target, Mapping):
        return dict(target)
    path = Path(target).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise HeadLayoutError(str(target), [f"the target has no {CONFIG_FILE}"])
    return json.loads(path.read_text())


def _rope_theta(config: Mapping[str, Any]) -> float | None:
    if "rope_theta" in config:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    return float(params["rope_theta"]) if "rope_theta" in params else None


def head_config(
    target: Mapping[str, Any],
    *,
    draft_vocab_size: int,
    target_name: str,
    intermediate_size: int | None = None,
    aux_layers: list[int] | None = None,
    torch_dtype: str | None = None,
    recipe: str = "",
    training: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``config.json`` of a head for the target whose HF config is ``target``: one decoder
    layer of the target's width, heads and RoPE; ``training``: facts about the training data
    (prompt-set digests, token count) kept under ``"agentrt"``."""
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(intermediate_size or target["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target.get("num_key_value_heads", heads)),
        "head_dim": int(target.get("head_dim") or hidden // heads),
        "hidden_act": target.get("hidden_act", "silu"),
        "rms_norm_eps": float(target["rms_norm_eps"]),
        "rope_theta": _rope_theta(target),
        "max_position_embeddings": int(target["max_position_embeddings"]),
        "num_hidden_layers": 1,
        "vocab_size": int(target["vocab_size"]),
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype or target.get("torch_dtype") or target.get("dtype") or "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(
                aux_layers or default_aux_layers(int(target["num_hidden_layers"]))),
            "use_aux_hidden_state": True,
        },
        "agentrt": {
            "target": target_name,
            "target_hidden_size": hidden,
            "target_vocab_size": int(target["vocab_size"]),
            "recipe": recipe,
            "format_version": FORMAT_VERSION,
            **dict(training or {}),
        },
    }
    for key in ("rope_scaling", "rope_parameters"):
        if target.get(key) is not None:
            config[key] = target[key]
    if config["rope_theta"] is None:
        del config["rope_theta"]
    return config


def tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a head with ``config`` holds, by name, with its shape."""
    hidden = int(config["hidden_size"])
    inner = int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    target_hidden = int(config.get("target_hidden_size") or hidden)
    draft_vocab, vocab = int(config["draft_vocab_size"]), int(config["vocab_size"])
    layer = "midlayer."
    return {
        "fc.weight": (hidden, 3 * target_hidden),
        layer + "input_layernorm.weight": (hidden,),
        layer + "hidden_norm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        layer + "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        layer + "post_attention_layernorm.weight": (hidden,),
        layer + "mlp.gate_proj.weight": (inner, hidden),
        layer + "mlp.up_proj.weight": (inner, hidden),
        layer + "mlp.down_proj.weight": (hidden, inner),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }


def vocab_maps(draft_to_target: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for a draft vocabulary given as the sorted target ids it holds."""
    ids = torch.as_tensor(draft_to_target, dtype=torch.int64)
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def write_head(directory: str | os.PathLike[str], config: Mapping[str, Any],
               tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write a head directory (``config.json``, ``model.safetensors``) after checking
    ``tensors`` against ``config``; weights are stored in the config's ``torch_dtype``."""
    from safetensors.torch import save_file

    where = Path(directory).expanduser()
    problems = _tensor_problems(config, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    problems += _vocab_problems(config, tensors.get("d2t"), tensors.get("t2d"))
    if problems:
        raise HeadLayoutError(f"head for {where}", problems)
    dtype = getattr(torch, str(config.get("torch_dtype", "float32")))
    stored = {name: (t if name in ("d2t", "t2d") else t.to(dtype)).detach().contiguous().cpu()
              for name, t in tensors.items()}
    where.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(where / (WEIGHTS_FILE + ".tmp")), metadata={"format": "pt"})
    os.replace(where / (WEIGHTS_FILE + ".tmp"), where / WEIGHTS_FILE)
    (where / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    return where


def check_head(directory: str | os.PathLike[str],
               target: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The head's config, once the directory is checked against the target (a model directory
    or its HF config): config fields, tensor names, shapes and dtypes, ``d2t``/``t2d``.
    Raises `HeadLayoutError` naming every problem found."""
    from safetensors import safe_open

    where = Path(directory).expanduser()
    config_path, weights_path = where / CONFIG_FILE, where / WEIGHTS_FILE
    missing = [p.name for p in (config_path, weights_path) if not p.is_file()]
    if missing:
        raise HeadLayoutError(f"EAGLE-3 head {where}", [f"missing {', '.join(missing)}"])
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise HeadLayoutError(f"EAGLE-3 head {where}", [f"{CONFIG_FILE} is not JSON ({exc})"])
    problems = _config_problems(config, target_config(target))
    if problems:  # shapes follow from the config: check those once it is right
        raise HeadLayoutError(f"EAGLE-3 head {where}", problems)
    with safe_open(str(weights_path), framework="pt") as f:
        found = {}
        for name in f.keys():
            piece = f.get_slice(name)
            found[name] = (tuple(piece.get_shape()),
                           _DTYPES.get(piece.get_dtype(), piece.get_dtype()))
        problems = _tensor_problems(config, found)
        if not problems:
            problems = _vocab_problems(config, f.get_tensor("d2t"), f.get_tensor("t2d"))
    if problems:
        raise HeadLayoutError(f"EAGLE-3 head {where}", problems)
    return config


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "rms_norm_eps", "max_position_embeddings", "num_hidden_layers", "vocab_size",
             "draft_vocab_size", "target_hidden_size", "eagle_config")


def _config_problems(config: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        return [f"config.json lacks {', '.join(missing)}"]
    problems = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures is {config.get('architectures')!r}, vLLM's eagle3 "
                        f"loads [{ARCHITECTURE!r}]")
    if config["num_hidden_layers"] != 1:
        problems.append(f"num_hidden_layers is {config['num_hidden_layers']}, the head has 1")
    target_hidden, target_vocab = int(target["hidden_size"]), int(target["vocab_size"])
    target_layers = int(target["num_hidden_layers"])
    name = config.get("agentrt", {}).get("target", "?")
    if config["target_hidden_size"] != target_hidden:
        problems.append(f"the head was made for a target of hidden size "
                        f"{config['target_hidden_size']} ({name}), "
                        f"this target's is {target_hidden}")
    if config["hidden_size"] != target_hidden:
        problems.append(f"hidden_size {config['hidden_size']} differs from the target's "
                        f"{target_hidden} (the head shares the target's embedding)")
    if config["vocab_size"] != target_vocab:
        problems.append(f"the head was made for a vocabulary of {config['vocab_size']} ({name}), "
                        f"this target's is {target_vocab}")
    if not 0 < config["draft_vocab_size"] <= config["vocab_size"]:
        problems.append(f"draft_vocab_size {config['draft_vocab_size']} is not in "
                        f"1..vocab_size ({config['vocab_size']})")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if kv_heads <= 0 or heads % kv_heads:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                        f"{kv_heads}")
    eagle = config["eagle_config"] if isinstance(config["eagle_config"], Mapping) else {}
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    if eagle.get("use_aux_hidden_state", True) is not True:
        problems.append("eagle_config.use_aux_hidden_state must be true (the head reads three "
                        "target layers through fc)")
    if layers is not None and (len(layers) != 3 or not all(
            isinstance(i, int) and 0 <= i < target_layers for i in layers)):
        problems.append(f"eagle_aux_hidden_state_layer_ids {layers} must be 3 layer indices of "
                        f"the target's {target_layers} layers")
    return problems


def _tensor_problems(config: Mapping[str, Any],
                     found: Mapping[str, tuple[tuple[int, ...], Any]]) -> list[str]:
    expected = tensor_shapes(config)
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {', '.join(unexpected)}")
    for name, shape in expected.items():
        if name not in found:
            continue
        got_shape, dtype = found[name]
        if got_shape != shape:
            problems.append(f"{name} has shape {list(got_shape)}, expected {list(shape)}")
        want = {"d2t": (torch.int64,), "t2d": (torch.bool,)}.get(name, WEIGHT_DTYPES)
        if dtype not in want:
            problems.append(f"{name} is {dtype}, expected {' or '.join(map(str, want))}")
    return problems


def _vocab_problems(config: Mapping[str, Any], d2t: torch.Tensor | None,
                    t2d: torch.Tensor | None) -> list[str]:
    if d2t is None or t2d is None:
        return []  # reported as missing tensors
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    vocab = int(config["vocab_size"])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return [f"d2t maps draft ids to target ids outside 0..{vocab - 1}"]
    if torch.unique(ids).numel() != ids.numel():
        return ["d2t maps several draft ids to the same target id"]
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[ids] = True
    if not torch.equal(marked, t2d.to(torch.bool)):
        return [f"t2d marks {int(t2d.sum())} target ids, d2t maps to {ids.numel()} others "
                "(they must be the same set)"]
    return []
