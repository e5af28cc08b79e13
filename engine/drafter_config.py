"""Drafter settings: the ``--drafter-config`` JSON, and vLLM's speculative-decoding counters as
`DecodeMetrics`.

vLLM counts drafting with four monotonic counters (Prometheus names in brackets):

- ``num_drafts`` (``vllm:spec_decode_num_drafts``): engine steps that verified a non-empty draft;
- ``num_draft_tokens`` (``vllm:spec_decode_num_draft_tokens``): tokens proposed;
- ``num_accepted_tokens`` (``vllm:spec_decode_num_accepted_tokens``): proposed tokens accepted;
- ``num_accepted_tokens_per_pos`` (``vllm:spec_decode_num_accepted_tokens_per_pos{position=i}``).

`DecodeCounters` holds one reading of them (plus ``vllm:generation_tokens``); the difference of two
readings taken around a generation is that generation's share, exact when nothing else ran on the
engine in between. `DecodeCounters.to_decode_metrics` maps a reading onto `DecodeMetrics`:

- every engine step emits its accepted draft tokens plus one token of the target, so
  ``verify_steps = generated_tokens - accepted_tokens`` (steps with no draft count as verify steps
  of one token, as in the native engine; ``tau`` is then tokens per target forward);
- vLLM does not count drafts per position; its own per-position rate divides by ``num_drafts``, so
  ``drafted_per_position[i] = num_drafts`` (exact for a fixed draft length, such as ngram's k).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .metrics import DecodeMetrics

SPEC_PREFIX = "vllm:spec_decode_"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"

_DRAFTS = SPEC_PREFIX + "num_drafts"
_DRAFT_TOKENS = SPEC_PREFIX + "num_draft_tokens"
_ACCEPTED = SPEC_PREFIX + "num_accepted_tokens"
_ACCEPTED_PER_POS = SPEC_PREFIX + "num_accepted_tokens_per_pos"


def parse_drafter_config(value: str | Path | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Read a ``--drafter-config``: a JSON object, a path to a JSON file, a mapping, or None/"" (off).

    The result is passed on as is: for vLLM it is vLLM's ``speculative_config``, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``; for the native
    engine ``method`` names the drafter and the other keys are `NativeConfig` fields, e.g.
    ``{"method": "ngram", "draft_tokens": 4}``. It is checked only for being an object with
    ``method`` or ``model``; the backend checks the rest.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        config = dict(value)
    else:
        text = str(value).strip()
        if not text or text.lower() in ("none", "off", "null"):
            return None
        config = read_json_object(text)
    if "method" not in config and "model" not in config:
        raise ValueError(
            "--drafter-config needs a 'method' (ngram, suffix, eagle3, mtp, draft_model, ...) or a "
            f"draft 'model'; got keys {sorted(config)}"
        )
    return config


def read_json_object(text: str, option: str = "--drafter-config") -> dict[str, Any]:
    """A JSON object given inline (``{...}``) or as the path of a JSON file."""
    text = text.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{option}: {text!r} is neither JSON nor a JSON file")
        text = path.read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{option} must be a JSON object, got {type(config).__name__}")
    return config


@dataclass
class DecodeCounters:
    """One reading of vLLM's cumulative spec-decode and generation counters."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    generation_tokens: int = 0
    has_drafter: bool = False
    """True when the engine reported spec-decode counters at all (a drafter is configured)."""

    def __sub__(self, before: DecodeCounters) -> DecodeCounters:
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        mine = _padded(self.accepted_per_position, width)
        theirs = _padded(before.accepted_per_position, width)
        return DecodeCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted_tokens=self.accepted_tokens - before.accepted_tokens,
            accepted_per_position=[a - b for a, b in zip(mine, theirs, strict=True)],
            generation_tokens=self.generation_tokens - before.generation_tokens,
            has_drafter=self.has_drafter or before.has_drafter,
        )

    def to_decode_metrics(self, generated_tokens: int | None = None) -> DecodeMetrics:
        """Map onto `DecodeMetrics` (see the module docstring for the conventions).

        ``generated_tokens`` overrides the counted ``generation_tokens`` (e.g. the usage of the one
        request this reading covers).
        """
        generated = self.generation_tokens if generated_tokens is None else generated_tokens
        accepted = min(self.accepted_tokens, generated)
        per_pos = list(self.accepted_per_position)
        return DecodeMetrics(
            generated_tokens=generated,
            verify_steps=_verify_steps(generated, accepted, self.drafts),
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=accepted,
            accepted_per_position=per_pos,
            drafted_per_position=[self.drafts] * len(per_pos),
        )


def _verify_steps(generated: int, accepted: int, drafts: int) -> int:
    """Target forwards behind ``generated`` tokens: each emits its accepted draft tokens plus one.

    vLLM counts a draft's accepted tokens before the output is cut at a stop token or at
    ``max_tokens``, so ``generated - accepted`` can come out below the number of drafts; a verify
    step per draft is the floor.
    """
    return max(generated - accepted, drafts, 0)


def _padded(values: list[int], width: int) -> list[int]:
    return list(values) + [0] * (width - len(values))


# ---------------------------------------------------------------- Prometheus text (/metrics)

_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$"
)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    """One sample line of the Prometheus text format."""

    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Parse Prometheus text exposition into samples (comments and malformed lines are skipped)."""
    samples: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(match["labels"] or "")}
        samples.append(Sample(match["name"], labels, value))
    return samples


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def counters_from_prometheus(text: str, model_name: str | None = None) -> DecodeCounters:
    """Read `DecodeCounters` from a vLLM server's ``/metrics`` text.

    Counters are summed over label sets (engines, models); give ``model_name`` to keep only the
    series labelled with that model. Both ``name`` and ``name_total`` spellings are accepted.
    """
    samples = [
        s for s in parse_prometheus(text)
        if model_name is None or s.labels.get("model_name", model_name) == model_name
    ]
    return _collect((_base_name(s.name), s.labels, s.value) for s in samples)


def counters_from_vllm_metrics(metrics: Iterable[Any]) -> DecodeCounters:
    """Read `DecodeCounters` from vLLM's in-process metrics snapshot (``get_metrics()``).

    Accepts vLLM's ``Counter`` / ``Vector`` metric objects (``name``, ``labels``, ``value`` or
    ``values``); anything else is ignored.
    """
    rows: list[tuple[str, dict[str, str], float]] = []
    for metric in metrics:
        name = _base_name(getattr(metric, "name", ""))
        labels = dict(getattr(metric, "labels", {}) or {})
        values = getattr(metric, "values", None)
        if name == _ACCEPTED_PER_POS and values is not None:
            for position, value in enumerate(values):
                rows.append((name, {**labels, "position": str(position)}, value))
        elif isinstance(getattr(metric, "value", None), (int, float)):
            rows.append((name, labels, metric.value))
    return _collect(rows)


def _base_name(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


def _collect(rows: Iterable[tuple[str, dict[str, str], float]]) -> DecodeCounters:
    out = DecodeCounters()
    per_pos: dict[int, float] = {}
    for name, labels, value in rows:
        if math.isnan(value):
            continue
        if name == _DRAFTS:
            out.drafts += int(value)
        elif name == _DRAFT_TOKENS:
            out.draft_tokens += int(value)
        elif name == _ACCEPTED:
            out.accepted_tokens += int(value)
        elif name == _ACCEPTED_PER_POS:
            position = int(labels.get("position", "0"))
            per_pos[position] = per_pos.get(position, 0) + value
        elif name == GENERATION_TOKENS:
            out.generation_tokens += int(value)
        else:
            continue
        if name.startswith(SPEC_PREFIX):
            out.has_drafter = True
    if per_pos:
        out.accepted_per_position = [int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)]
    return out


# ---------------------------------------------------------------- vLLM per-request metrics


def decode_metrics_from_request(summary: Mapping[str, Any], generated_tokens: int) -> DecodeMetrics:
    """Map vLLM's per-request spec-decode summary onto `DecodeMetrics`.

    ``summary`` is ``RequestSpecDecodeMetrics.to_dict()`` in process, or the response's
    ``metrics.speculative_decoding`` from a server started with
    ``--per-request-spec-decode-metrics summary|detailed``. ``acceptance_histogram[j]`` counts
    verify steps that accepted exactly ``j`` draft tokens, so position ``i`` was accepted by
    ``sum(histogram[i+1:])`` drafts. Drafts per position are exact with the ``detailed`` level
    (``per_step_drafted``), otherwise every draft is taken to have ``num_spec_tokens`` tokens.
    These numbers belong to this one request, whatever else the engine runs.
    """
    histogram = [int(v) for v in summary.get("acceptance_histogram") or []]
    drafts = int(summary.get("num_spec_steps", sum(histogram)))
    accepted = int(
        summary.get("num_accepted_draft_tokens", sum(j * n for j, n in enumerate(histogram)))
    )
    width = int(summary.get("num_spec_tokens") or max(len(histogram) - 1, 0))
    accepted_per_position = [sum(histogram[i + 1:]) for i in range(width)]
    per_step_drafted = summary.get("per_step_drafted")
    if per_step_drafted:
        drafted_per_position = [0] * width
        for drafted in per_step_drafted:
            for i in range(min(int(drafted), width)):
                drafted_per_position[i] += 1
    else:
        drafted_per_position = [drafts] * width
    accepted = min(accepted, generated_tokens)
    return DecodeMetrics(
        generated_tokens=generated_tokens,
        verify_steps=_verify_steps(generated_tokens, accepted, drafts),
        drafts=drafts,
        draft_tokens=int(summary.get("num_draft_tokens", 0)),
        accepted_tokens=accepted,
        accepted_per_position=accepted_per_position,
        drafted_per_position=drafted_per_position,
    )
