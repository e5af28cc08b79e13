"""The draft head: one decoder layer over fused target features (EAGLE-3's design).

At position t the head reads ``h_t = fc(concat(aux_low, aux_mid, aux_high))`` (the target's
residual stream entering three of its layers at t) and ``e_{t+1}``, the target's embedding of
the token at t+1; it predicts the token at t+2. Drafting further ahead feeds its own pre-norm
output back in place of ``h``. The layer: ``x = concat(input_layernorm(e), hidden_norm(h))``;
grouped-query attention with RoPE over the head's own keys and values of earlier positions;
``h2 = o_proj(attn) + h``; ``out = mlp(post_attention_layernorm(h2)) + h2``; logits =
``lm_head(norm(out))`` over a reduced draft vocabulary, draft id ``d`` meaning target id
``d + d2t[d]``.

A trained head is a directory that vLLM's ``eagle3`` method loads as is (``config.json`` +
``model.safetensors``, see `save` and docs/engine.md "The learned drafter").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agentrt.errors import AgentrtError

from ..eagle3_layout import CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE, write_head
from ..eagle3_layout import default_aux_layers as _layout_aux_layers
from ..llama import LlamaConfig, rope_frequencies

def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default feature layers for a target of ``num_layers``: (2, n // 2, n - 3)."""
    low, mid, high = _layout_aux_layers(num_layers)
    return (low, mid, high)


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape and what it was trained for (the ``config.json`` of its directory)."""

    target: str
    """The target model's name (e.g. ``"smollm2-135m"``)."""
    target_hidden_size: int
    target_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int
    aux_layers: tuple[int, int, int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    recipe: str = "default"
    data: dict[str, Any] = field(default_factory=dict)
    """Training-data facts (prompt-set digests, token counts)."""

    @classmethod
    def for_target(cls, target: str, cfg: LlamaConfig, draft_vocab_size: int,
                   recipe: str = "default", data: dict | None = None) -> HeadConfig:
        """A head sized as the target's layers (it shares the target's embedding)."""
        return cls(target=target, target_hidden_size=cfg.hidden_size,
                   target_vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   draft_vocab_size=draft_vocab_size, aux_layers=default_aux_layers(cfg.num_layers),
                   rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                   rope_scaling=cfg.rope_scaling,
                   max_position_embeddings=cfg.max_position_embeddings, recipe=recipe,
                   data=dict(data or {}))

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` vLLM's ``eagle3`` reads, with agentrt's facts under ``agentrt``."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "num_hidden_layers": 1, "vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False,
            "torch_dtype": "float32", "hidden_act": "silu",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                             "use_aux_hidden_state": True},
            "agentrt": {"target": self.target, "target_hidden_size": self.target_hidden_size,
                        "target_vocab_size": self.target_vocab_size, "recipe": self.recipe,
                        "format_version": FORMAT_VERSION, **self.data},
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @classmethod
    def from_json(cls, cfg: dict[str, Any], where: str = "config.json") -> HeadConfig:
        """Read a head's ``config.json`` (a `ValueError` names a missing field and the file)."""
        try:
            facts = dict(cfg.get("agentrt") or {})
            version = facts.pop("format_version", FORMAT_VERSION)
            if version != FORMAT_VERSION:
                raise ValueError(f"format_version {version}, this agentrt reads {FORMAT_VERSION}")
            target = facts.pop("target", "unknown")
            recipe = facts.pop("recipe", "unknown")
            facts.pop("target_hidden_size", None)
            facts.pop("target_vocab_size", None)
            return cls(
                target=target, target_hidden_size=int(cfg["target_hidden_size"]),
                target_vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]),
                draft_vocab_size=int(cfg["draft_vocab_size"]),
                aux_layers=tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=cfg.get("rope_scaling"),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                recipe=recipe, data=facts)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: not a draft-head config (missing or bad {exc})") from None

    def rope_config(self) -> LlamaConfig:
        """The fields `rope_frequencies` reads."""
        return LlamaConfig(vocab_size=self.target_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling)


class TargetMismatchError(AgentrtError, ValueError):
    """A head trained for another target model."""


def check_target(head: HeadConfig, name: str | None, cfg: LlamaConfig, where: str = "") -> None:
    """Refuse a head trained for another target: a `TargetMismatchError` naming both (model
    name, hidden size, vocabulary). ``name`` None (a target given as a directory) checks the
    shapes only."""
    same_shape = ((head.target_hidden_size, head.target_vocab_size) == (cfg.hidden_size, cfg.vocab_size)
                  and max(head.aux_layers) < cfg.num_layers)
    if same_shape and (name is None or head.target == name):
        return
    at = f" at {where}" if where else ""
    raise TargetMismatchError(
        f"draft head{at} was trained for {head.target!r} (hidden size {head.target_hidden_size}, "
        f"vocabulary {head.target_vocab_size}, feature layers {list(head.aux_layers)}); the "
        f"target is {name or 'a local model'!r} (hidden size {cfg.hidden_size}, vocabulary "
        f"{cfg.vocab_size}, {cfg.num_layers} layers): train a head for it with "
        f"`agentrt draft train --model {name or '<model>'}`")


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        width = 2 * c.hidden_size
        self.q_proj = nn.Linear(width, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)


@dataclass
class HeadCache:
    """The head's keys and values of one sequence: entries for positions ``start ..
    start + length - 1`` (grown on demand)."""

    keys: Tensor
    values: Tensor
    start: int = 0
    length: int = 0

    @classmethod
    def empty(cls, c: HeadConfig, capacity: int = 256) -> HeadCache:
        shape = (capacity, c.num_kv_heads, c.head_dim)
        return cls(torch.empty(shape), torch.empty(shape))

    @property
    def end(self) -> int:
        """The position after the last entry."""
        return self.start + self.length

    def restart(self, position: int) -> None:
        """Drop every entry; the next one is for ``position``."""
        self.start, self.length = position, 0

    def copy_until(self, end: int) -> HeadCache:
        """A copy holding the entries for positions ``start .. end - 1``."""
        n = end - self.start
        return HeadCache(self.keys[:n].clone(), self.values[:n].clone(), self.start, n)

    def append(self, k: Tensor, v: Tensor) -> None:
        n = k.shape[0]
        if self.length + n > self.keys.shape[0]:
            grow = max(2 * self.keys.shape[0], self.length + n)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = torch.empty((grow, *old.shape[1:]), dtype=old.dtype)
                new[:self.length] = old[:self.length]
                setattr(self, name, new)
        self.keys[self.length:self.length + n] = k
        self.values[self.length:self.length + n] = v
        self.length += n


class DraftHead(nn.Module):
    """The head's weights (named as EAGLE-3 checkpoints name them) and its forwards: `extend`
    (inference over its own `HeadCache`) and `train_forward` (training-time test)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.drafting: dict[str, Tensor] = {}
        """Matrices for drafting (`prepare_drafting`); empty: the modules' own."""
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool))
        self.t2d[:c.draft_vocab_size] = True  # until `set_vocabulary`: the first ids, as d2t says
        freqs = rope_frequencies(c.rope_config(), c.max_position_embeddings)
        self.register_buffer("rope_cos", freqs.real.repeat(1, 2).contiguous(), persistent=False)
        self.register_buffer("rope_sin", freqs.imag.repeat(1, 2).contiguous(), persistent=False)

    # ------------------------------------------------------------------ vocabulary

    def set_vocabulary(self, target_ids: Sequence[int]) -> None:
        """Make the draft vocabulary ``target_ids`` (sorted; draft id i is the i-th)."""
        ids = torch.tensor(sorted(set(int(t) for t in target_ids)), dtype=torch.long)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"{ids.numel()} draft tokens for a head of "
                             f"{self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> Tensor:
        """Target token id of each draft id."""
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    def draft_ids(self, target_ids: Tensor) -> Tensor:
        """Draft id of each target id (-1 where outside the draft vocabulary)."""
        lookup = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long)
        lookup[self.target_ids()] = torch.arange(self.config.draft_vocab_size)
        return lookup[target_ids]

    # ---------------------------------------------------------------------- pieces

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate-half RoPE of ``x[..., n, heads, head_dim]`` at ``positions[n]``."""
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, h: Tensor, e: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values ``[..., n, heads, head_dim]`` of rows ``(h, e)``."""
        c, layer = self.config, self.midlayer
        x = torch.cat([_norm(layer.input_layernorm, e), _norm(layer.hidden_norm, h)], dim=-1)
        attn = layer.self_attn
        q, k, v = self._project("qkv", x, attn.q_proj, attn.k_proj, attn.v_proj)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish(self, attn: Tensor, h: Tensor) -> Tensor:
        """The layer's pre-norm output from attention rows ``[..., n, heads * head_dim]``."""
        layer = self.midlayer
        mlp = layer.mlp
        h2 = self._project("o", attn, layer.self_attn.o_proj)[0] + h
        gate, up = self._project("gate_up", _norm(layer.post_attention_layernorm, h2),
                                 mlp.gate_proj, mlp.up_proj)
        return self._project("down", F.silu(gate) * up, mlp.down_proj)[0] + h2

    def logits(self, out: Tensor) -> Tensor:
        """Draft-vocabulary logits of pre-norm outputs."""
        return self._project("lm_head", _norm(self.norm, out), self.lm_head)[0]

    def fuse(self, features: Tensor) -> Tensor:
        """``fc`` of target features ``[..., 3 * target_hidden]``."""
        if not self.drafting:
            features = features.to(self.fc.weight.dtype)
        return self._project("fc", features, self.fc)[0]

    def _project(self, name: str, x: Tensor, *layers: nn.Linear) -> tuple[Tensor, ...]:
        """``layer(x)`` for each of ``layers`` (same input); on a head prepared for drafting,
        one matmul with the stacked ``name`` matrix, float32 out."""
        if not self.drafting:
            return tuple(layer(x) for layer in layers)
        w = self.drafting[name]
        y = F.linear(x.to(w.dtype), w).float()
        return y.split([layer.out_features for layer in layers], dim=-1)

    def prepare_drafting(self, dtype: torch.dtype = torch.bfloat16) -> DraftHead:
        """Make this head's forwards use copies of its matrices in ``dtype`` (a one-row head
        step is bound by reading them: bfloat16 halves that), q/k/v and gate/up stacked into
        one matrix each; returns the head. For inference only: training updates the original
        matrices, not these copies."""
        a, m = self.midlayer.self_attn, self.midlayer.mlp
        with torch.no_grad():
            self.drafting = {
                "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).to(dtype),
                "o": a.o_proj.weight.to(dtype),
                "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]).to(dtype),
                "down": m.down_proj.weight.to(dtype),
                "lm_head": self.lm_head.weight.to(dtype),
                "fc": self.fc.weight.to(dtype),
            }
        return self

    # ------------------------------------------------------------------ inference

    def extend(self, cache: HeadCache, h: Tensor, e: Tensor) -> Tensor:
        """Run rows ``h[n, H]`` (fused features or earlier outputs) with token embeddings
        ``e[n, H]`` at the positions after ``cache``'s, appending their keys and values;
        returns the pre-norm outputs ``[n, H]``."""
        c = self.config
        n = h.shape[0]
        positions = torch.arange(cache.end, cache.end + n)
        q, k, v = self._qkv(h, e, positions)
        cache.append(k, v)
        keys = cache.keys[:cache.length].transpose(0, 1)  # [kv_heads, L, D]
        values = cache.values[:cache.length].transpose(0, 1)
        groups = c.num_heads // c.num_kv_heads
        # the query heads sharing a kv head stacked along the query axis: [kv_heads, groups * n, D]
        grouped = q.transpose(0, 1).reshape(c.num_kv_heads, groups * n, c.head_dim)
        scores = grouped @ keys.transpose(1, 2) * (1.0 / math.sqrt(c.head_dim))
        if n > 1:
            future = torch.arange(cache.length)[None, :] > torch.arange(cache.length - n, cache.length)[:, None]
            scores = scores.masked_fill(future.repeat(groups, 1), float("-inf"))
        attn = (torch.softmax(scores, dim=-1) @ values).view(c.num_heads, n, c.head_dim)
        return self._finish(attn.transpose(0, 1).flatten(-2), h)

    # ------------------------------------------------------------------- training

    def train_forward(self, features: Tensor, next_embeds: Tensor, positions: Tensor,
                      steps: int) -> list[Tensor]:
        """Training-time test over ``[B, T]`` rows: step 0 reads the fused target features at
        every position; step j reads, at position t, the head's own step j-1 output at t-1, and
        attends to the step-0 keys up to t-j and to its own steps' keys at t-j+1 .. t (exactly
        what drafting j tokens after position t-j sees). Returns the pre-norm outputs
        ``[B, T, H]`` of each step."""
        c = self.config
        groups = c.num_heads // c.num_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        e = next_embeds
        h = self.fuse(features)
        T = h.shape[1]
        keys: list[Tensor] = []
        values: list[Tensor] = []
        outs = []
        t = torch.arange(T)
        for j in range(steps):
            q, k, v = self._qkv(h, e, positions)  # [B, T, heads|kv, D]
            keys.append(k.repeat_interleave(groups, dim=2).transpose(1, 2))  # [B, heads, T, D]
            values.append(v.repeat_interleave(groups, dim=2).transpose(1, 2))
            q = q.transpose(1, 2)
            scores = [q @ keys[0].transpose(-1, -2) * scale]
            scores[0] = scores[0].masked_fill(t[None, :] > (t[:, None] - j), float("-inf"))
            shifted_values = []
            for i in range(1, j + 1):
                shift = j - i
                ks = _shift(keys[i], shift)
                scores.append(((q * ks).sum(-1) * scale).masked_fill(t < shift, float("-inf"))[..., None])
                shifted_values.append(_shift(values[i], shift))
            weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
            attn = weights[..., :T] @ values[0]
            for i, vs in enumerate(shifted_values):
                attn = attn + weights[..., T + i:T + i + 1] * vs
            out = self._finish(attn.transpose(1, 2).flatten(-2), h)
            outs.append(out)
            h = _shift(out, 1, dim=1)
        return outs

    # ----------------------------------------------------------------- save / load

    def save(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into directory ``path`` through the
        shared layout writer (`eagle3_layout.write_head`, which checks every tensor's name and
        shape against the config first; weights before the config)."""
        tensors = {name: t.detach() for name, t in self.state_dict().items()}
        return write_head(path, self.config.to_json(), tensors)

    @classmethod
    def load(cls, path: str | Path) -> DraftHead:
        """Read a head directory written by `save` (or any EAGLE-3 head in that layout)."""
        from safetensors.torch import load_file

        path = Path(path)
        config_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
        if not config_file.is_file() or not weights.is_file():
            raise FileNotFoundError(f"no draft head at {path} (needs {CONFIG_FILE} and "
                                    f"{WEIGHTS_FILE}; make one with `agentrt draft train`)")
        config = HeadConfig.from_json(json.loads(config_file.read_text()), str(config_file))
        head = cls(config)
        tensors = load_file(str(weights))
        tensors["t2d"] = tensors["t2d"].bool()
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"{weights}: missing tensors {missing}, unexpected {unexpected}")
        return head.eval()


def _norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """RMSNorm computed in float32 (also under autocast, as vLLM computes it)."""
    return F.rms_norm(x.float(), norm.normalized_shape, norm.weight, norm.eps)


def _shift(x: Tensor, by: int, dim: int = 2) -> Tensor:
    """``x`` moved ``by`` places later along ``dim`` (zeros in front)."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - by)], dim=dim)


def head_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """Where ``agentrt draft train`` puts the head for model ``model``:
    ``<cache>/models/<model>/drafters/eagle``."""
    from ..models import home

    return home(cache_dir) / "models" / model / "drafters" / "eagle"


def model_name(model: str | Path) -> str | None:
    """The registry name of ``model``: the name itself, or the name a pulled model directory's
    manifest records (None for another local directory)."""
    from ..models import MANIFEST

    path = Path(model).expanduser()
    if not path.is_dir():
        return str(model)
    try:
        return json.loads((path / MANIFEST).read_text())["name"]
    except (OSError, ValueError, KeyError):
        return None
