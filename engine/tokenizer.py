"""Text in and out of the native engine: chat template, incremental detokenisation, stop strings.

`ChatTokenizer` wraps the model directory's own tokenizer and chat template (loaded with
``local_files_only``). `IncrementalDetokenizer` turns a growing list of token ids into text
deltas that never end in a broken UTF-8 sequence. `StopStringMatcher` finds stop strings that
span token boundaries, holding back text that could still become one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

REPLACEMENT_CHAR = "\ufffd"


class ChatTokenizer:
    """A model directory's tokenizer and chat template."""

    def __init__(self, path: str | os.PathLike):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.path = Path(path)
        self.hf = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.eos_token_ids = frozenset(self._eos_ids())

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        for name in ("generation_config.json", "config.json"):
            file = self.path / name
            if file.is_file():
                eos = json.loads(file.read_text()).get("eos_token_id")
                ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def end_of_turn_id(self) -> int:
        """The token that ends a reply: the tokenizer's EOS (``<|im_end|>`` for chat models),
        else the lowest EOS id of the model's configs."""
        if self.hf.eos_token_id is not None:
            return int(self.hf.eos_token_id)
        if not self.eos_token_ids:
            raise ValueError(f"{self.path}: no end-of-sequence token in the tokenizer or configs")
        return min(self.eos_token_ids)

    def encode_chat(self, messages: Sequence[dict[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template."""
        if self.hf.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            if add_generation_prompt:
                text += "assistant: "
        else:
            text = self.hf.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token markup in the text is honoured; no BOS added)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of ``token_ids``, special tokens dropped."""
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def detokenizer(self) -> "IncrementalDetokenizer":
        """A fresh incremental detokenizer for one generation."""
        return IncrementalDetokenizer(self.decode)


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence.

    Each `push` decodes a short window (the last emitted tokens plus the new ones) and emits the
    text beyond what that window already produced, unless the text ends in an incomplete UTF-8
    sequence, in which case it waits for more tokens. The window keeps leading-space and byte
    merging rules of the tokenizer intact.
    """

    def __init__(self, decode):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    """Cuts a text stream at the first stop string, even one split across pushes.

    `push` returns ``(text_to_emit, stopped)``. Text that could be the start of a stop string is
    held back until it is clearly not one; the stop string itself is never emitted.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return buffer[:cut], True
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of the stream."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
