"""A step's plan: which requests run, with which rows, drafts and KV slots.

`drafting.choose_drafts` says what each decoding request would verify (`DraftChoice`);
`Scheduler.plan` fits that and the prompts still prefilling into the step's rows and blocks
(`StepPlan`); the engine's step executes the plan: it runs the model drafts into their slots
(`drafting.draft_models`), one forward over `StepPlan.inputs`, and hands each request its share
of the outputs (`StepPlan.outputs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .drafters.base import Draft, DraftSlots
from .llama import SeqRows

if TYPE_CHECKING:
    from .sequence import RequestState


@dataclass
class Selection:
    """The requests that take part in a step (`Scheduler.select`)."""

    order: list[RequestState]
    """Running requests in scheduling order (the less urgent ones left out of an urgent-only
    step)."""
    decoding: list[RequestState]
    urgent: int | None
    """The most urgent priority among decoding requests (None: none decodes)."""
    throttled: bool
    """Less urgent requests run beside a decoding urgent one."""
    shared: bool
    """This step includes them (the credit allows it)."""


@dataclass
class DraftChoice:
    """What one decoding request would verify after its last token: ``tokens`` of ``draft``
    drafted already (a lookup), and ``model_k`` more for the model drafter to draft once the
    step's rows are planned."""

    tokens: list[int] = field(default_factory=list)
    draft: Draft = field(default_factory=lambda: Draft([]))
    model_k: int = 0

    @property
    def rows(self) -> int:
        """The rows it asks for: the last token and every drafted one."""
        return 1 + len(self.tokens) + self.model_k


@dataclass
class DecodeRows:
    """A decoding request's rows: its last token, then ``drafted`` (of ``draft``); ``model_k``
    rows are reserved for model drafts not run yet (`fill`)."""

    seq: RequestState
    drafted: list[int]
    draft: Draft
    model_k: int = 0

    @property
    def n(self) -> int:
        return 1 + len(self.drafted) + self.model_k

    def slots(self) -> DraftSlots:
        """Where a drafter that writes the target's cache may put this request's model drafts:
        the positions of the rows reserved for them."""
        return DraftSlots(self.seq.computed, self.seq.block_table(), self.model_k)

    def fill(self, draft: Draft) -> None:
        """The model drafter's ``draft`` takes the reserved rows (those it leaves do not run)."""
        self.drafted, self.draft, self.model_k = draft.tokens[:self.model_k], draft, 0


@dataclass
class PrefillRows:
    """A chunk of ``n`` prompt tokens of a request still reading its prompt."""

    seq: RequestState
    n: int

    @property
    def last(self) -> bool:
        """The chunk reaches the last known token: its last row's logits give the first output."""
        return self.seq.computed + self.n >= len(self.seq.tokens)


@dataclass
class StepInputs:
    """A planned step as the forward takes it."""

    tokens: torch.Tensor
    rows: list[SeqRows]
    logit_rows: torch.Tensor


@dataclass
class StepPlan:
    """One step: decode rows first (scheduling order), then prefill chunks."""

    selection: Selection
    decode: list[DecodeRows]
    prefill: list[PrefillRows]

    @property
    def groups(self) -> list[DecodeRows | PrefillRows]:
        """Every request's rows, in the order they run."""
        return [*self.decode, *self.prefill]

    @property
    def rows(self) -> int:
        return sum(g.n for g in self.groups)

    @property
    def prefill_tokens(self) -> int:
        return sum(g.n for g in self.prefill)

    def inputs(self, device: torch.device) -> StepInputs:
        """The step's token ids, each request's rows, and the rows whose logits are read (a
        decode row's every row, a last prefill chunk's last row)."""
        tokens: list[int] = []
        rows: list[SeqRows] = []
        logit_rows: list[int] = []
        for g in self.groups:
            seq, at = g.seq, len(tokens)
            if isinstance(g, DecodeRows):
                tokens += [seq.tokens[-1], *g.drafted]
                logit_rows += range(at, at + g.n)
            else:
                tokens += seq.tokens[seq.computed:seq.computed + g.n]
                if g.last:
                    logit_rows.append(at + g.n - 1)
            rows.append(SeqRows(seq.computed, g.n, seq.block_table()))
        return StepInputs(torch.tensor(tokens, dtype=torch.long, device=device), rows,
                          torch.tensor(logit_rows, dtype=torch.long))

    def outputs(self, logits: torch.Tensor, features: torch.Tensor | None
                ) -> Iterator[tuple[DecodeRows | PrefillRows, torch.Tensor | None, torch.Tensor | None]]:
        """Each group with its logits (``[1, rows read, V]``; None for a prefill chunk short of
        the last token) and its captured feature rows (None when none were captured)."""
        groups = self.groups
        read = [g.n if isinstance(g, DecodeRows) else int(g.last) for g in groups]
        at = first = 0
        for g, m in zip(groups, read):
            mine = logits[at:at + m][None] if m else None
            yield g, mine, None if features is None else features[first:first + g.n]
            at += m
            first += g.n
