"""The training prompt mix, generated (never read from a benchmark or test), and the check that
keeps it apart from every evaluation prompt.

Three kinds, drawn from templates and word lists written for this purpose:

- ``agent``: REPL-agent turns: a system prompt naming the tools of a Python REPL, a task over a
  data variable, sometimes an earlier code turn and its printed output;
- ``chat``: everyday questions and requests;
- ``code``: small programming tasks, explanations and fixes.

`check_no_overlap` fails when any training message shares a run of `SHINGLE` words with a held-out
text; `heldout_texts` collects the benchmark prompt sets, the OOLONG trajectory and few-shot
templates and every string in the tests.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from agentrt.errors import AgentrtError

Messages = list[dict[str, str]]

KINDS = ("agent", "chat", "code")
SHINGLE = 8
"""Words in a run that counts as overlap."""

_TOOLS = [
    ("lookup(term: str) -> list[str]", "the records that mention `term`"),
    ("fetch_row(key: str) -> dict", "one record by its key"),
    ("ask_model(question: str, text: str) -> str", "a helper model's answer about `text`"),
    ("tally(items: list) -> dict", "how often each distinct item occurs"),
    ("sql(statement: str) -> list[tuple]", "rows from the table `sales` (date, region, amount, agent)"),
    ("read_log(day: str) -> list[str]", "the server log lines of one day, oldest first"),
    ("web_get(url: str) -> str", "the text of a web page"),
    ("submit(result)", "hand in the final result; call it once"),
]
_DATA = [
    ("records", "a list of dicts with keys 'key', 'owner', 'status' and 'body'"),
    ("tickets", "a list of support tickets, each a dict with 'id', 'priority', 'customer', 'note'"),
    ("pages", "a dict from page title to page text"),
    ("rows", "a list of (timestamp, user, action) tuples from an audit trail"),
    ("notes", "a long string: meeting notes, one item per line"),
]
_SUBJECTS = ["refunds", "late deliveries", "password resets", "the Berlin office", "overtime",
             "server restarts", "new hires", "duplicate payments", "the mobile app", "shipping fees",
             "contract renewals", "the spring campaign", "storage quotas", "broken links",
             "warranty claims", "night shifts", "vendor audits", "error 503", "API keys", "discounts"]
_AGENT_TASKS = [
    "Count how many {data} are about {subject}.",
    "Find the owner who appears most often in {data} and report the count.",
    "List every entry in {data} that mentions {subject}, newest first, at most five.",
    "Summarise what {data} says about {subject} in two sentences.",
    "Which entries in {data} are still open and mention {subject}? Return their ids.",
    "Group {data} by status and give the size of each group.",
    "Is {subject} mentioned more often than {other}? Answer yes or no with both counts.",
    "Extract every date in {data} that is near the words '{subject}' and return them sorted.",
    "Compute the share of {data} that concern {subject}, as a percentage with one decimal.",
    "Pick the three longest entries of {data} and ask the helper model what they have in common.",
]
_EARLIER_CODE = [
    "```repl\nprint(type({data}), len({data}))\nprint({data}[:2])\n```\n",
    "```repl\nmatches = lookup('{subject}')\nprint(len(matches))\nprint(matches[:3])\n```\n",
    "```repl\ncounts = tally([r['status'] for r in {data}])\nprint(counts)\n```\n",
    "```repl\nfor item in list({data})[:5]:\n    print(item)\n```\n",
]
_EARLIER_OUTPUT = ["Output:\n{n}", "Output:\n{n} entries; first: 'k-{n}'", "Output:\n{{'open': {n}, 'closed': 7}}",
                   "Output:\nTraceback (most recent call last):\nNameError: name 'x' is not defined"]

_CHAT = [
    "Why do {things} {verb}?", "Explain {topic} to a twelve-year-old.",
    "Give me {n} practical ideas for {activity}.", "Write a haiku about {thing}.",
    "What should I know before {activity}?", "Compare {topic} and {topic2} in a few lines.",
    "Draft a polite email asking a colleague about {thing}.", "How can I get better at {activity}?",
    "Tell me a short story in which {thing} plays a part.", "What are common mistakes people make with {topic}?",
    "Summarise the main arguments for and against {topic}.", "Plan a one-day trip around {thing}.",
]
_THINGS = ["autumn leaves", "a lighthouse", "old maps", "coffee", "a bicycle", "thunderstorms",
           "bread dough", "a chess clock", "mountain lakes", "paper cranes", "city parks", "owls"]
_TOPICS = ["compound interest", "photosynthesis", "supply chains", "remote work", "vaccines",
           "public transport", "recycling", "the stock market", "sleep cycles", "volcanoes",
           "electric cars", "machine translation", "tides", "inflation"]
_ACTIVITIES = ["learning a language", "running a marathon", "baking sourdough", "public speaking",
               "saving money", "growing tomatoes", "writing a novel", "moving abroad",
               "starting a podcast", "hiking in winter"]
_VERBS = ["change colour", "float", "make noise", "last so long", "matter", "fail"]

_CODE = [
    "Write a {lang} function `{name}` that {task}.",
    "Write a Python function that {task}, with a docstring and two doctests.",
    "How would you {task} in {lang} without any library? Show the code.",
    "Write unit tests for a {lang} function that {task}.",
    "Fix this function so that it {task}:\n```python\ndef {name}(xs):\n    out = []\n    for x in xs:\n        out.append(x)\n    return out[0]\n```",
    "Write a short shell command that {shell}.",
    "Explain what this code does:\n```python\n{snippet}\n```",
]
_CODE_TASKS = [
    ("dedupe", "removes duplicates from a list while keeping the order"),
    ("chunked", "splits a list into chunks of size n"),
    ("word_freq", "counts words in a text, ignoring case and punctuation"),
    ("flatten", "flattens a nested list of any depth"),
    ("is_anagram", "tells whether two strings are anagrams"),
    ("median", "returns the median of a list of numbers"),
    ("parse_kv", "parses 'a=1;b=2' into a dict of ints"),
    ("rotate", "rotates a list k places to the right"),
    ("merge_sorted", "merges two sorted lists into one sorted list"),
    ("top_k", "returns the k most common items of an iterable"),
]
_LANGS = ["Python", "JavaScript", "Go", "Rust", "Java", "C"]
_SHELL = ["lists the ten largest files in a directory", "counts lines in every .py file",
          "finds files changed in the last day", "replaces tabs with spaces in a file"]
_SNIPPETS = [
    "result = {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:3]}",
    "with open(path) as f:\n    lines = [l.rstrip() for l in f if l.strip()]",
    "total = sum(x * w for x, w in zip(values, weights)) / sum(weights)",
    "seen = set()\nfor n in nums:\n    if target - n in seen:\n        print(n, target - n)\n    seen.add(n)",
]


def _agent(rng: random.Random) -> Messages:
    tools = rng.sample(_TOOLS[:-1], rng.randint(2, 4)) + [_TOOLS[-1]]
    data, data_doc = rng.choice(_DATA)
    tool_lines = "\n".join(f"- `{sig}`: {doc}." for sig, doc in tools)
    system = (f"You operate a Python REPL to solve data tasks. The variable `{data}` holds "
              f"{data_doc}. Reply with one ```repl code block per turn; you will see what it "
              f"prints.\n\nFunctions you can call:\n{tool_lines}\n\nInspect before you "
              f"conclude, print only what you need, and finish with `submit(...)`.")
    subject, other = rng.sample(_SUBJECTS, 2)
    fill = dict(data=data, subject=subject, other=other, n=rng.randint(2, 60))
    messages = [{"role": "system", "content": system}]
    if rng.random() < 0.5:
        messages.append({"role": "user", "content": rng.choice(_AGENT_TASKS).format(**fill)})
        messages.append({"role": "assistant", "content": rng.choice(_EARLIER_CODE).format(**fill)})
        messages.append({"role": "user", "content": rng.choice(_EARLIER_OUTPUT).format(**fill)})
        if rng.random() < 0.5:
            return messages
        fill["subject"] = rng.choice(_SUBJECTS)
    messages.append({"role": "user", "content": rng.choice(_AGENT_TASKS).format(**fill)})
    return messages


def _chat(rng: random.Random) -> Messages:
    t1, t2 = rng.sample(_TOPICS, 2)
    text = rng.choice(_CHAT).format(things=rng.choice(_THINGS), verb=rng.choice(_VERBS), topic=t1,
                                    topic2=t2, n=rng.randint(3, 6), activity=rng.choice(_ACTIVITIES),
                                    thing=rng.choice(_THINGS))
    return [{"role": "user", "content": text}]


def _code(rng: random.Random) -> Messages:
    name, task = rng.choice(_CODE_TASKS)
    text = rng.choice(_CODE).format(name=name, task=task, lang=rng.choice(_LANGS), shell=rng.choice(_SHELL),
                                    snippet=rng.choice(_SNIPPETS))
    return [{"role": "user", "content": text}]


_MAKERS = {"agent": _agent, "chat": _chat, "code": _code}


def training_prompts(count: int, seed: int = 0, mix: Sequence[float] = (0.5, 0.25, 0.25)
                     ) -> list[tuple[str, Messages]]:
    """``count`` distinct ``(kind, messages)`` prompts, the kinds in proportion ``mix``
    (agent, chat, code)."""
    rng = random.Random(seed)
    out: list[tuple[str, Messages]] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"the templates hold fewer than {count} distinct prompts")
        kind = rng.choices(KINDS, weights=mix)[0]
        messages = _MAKERS[kind](rng)
        key = json.dumps(messages, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((kind, messages))
    return out


def digest(prompts: Iterable[tuple[str, Messages]]) -> str:
    """sha256 of a prompt list (recorded with the head)."""
    h = hashlib.sha256()
    for kind, messages in prompts:
        h.update(json.dumps([kind, messages], sort_keys=True).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------ held-out check

def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class PromptOverlapError(AgentrtError, ValueError):
    """A training prompt shares text with a held-out (evaluation) prompt."""


def check_no_overlap(prompts: Iterable[tuple[str, Messages]], heldout: Iterable[tuple[str, str]],
                     n: int = SHINGLE) -> int:
    """Raise `PromptOverlapError` when a training message equals a held-out text or shares a run
    of ``n`` words with one (``heldout``: ``(where, text)`` pairs); returns how many held-out
    texts were checked."""
    index: dict[tuple[str, ...], str] = {}
    exact: dict[str, str] = {}
    checked = 0
    for where, text in heldout:
        checked += 1
        norm = " ".join(_words(text))
        if norm:
            exact.setdefault(norm, where)
        for s in _shingles(text, n):
            index.setdefault(s, where)
    for i, (kind, messages) in enumerate(prompts):
        for message in messages:
            text = message["content"]
            where = exact.get(" ".join(_words(text)))
            hit = next((s for s in _shingles(text, n) if s in index), None)
            if where is None and hit is not None:
                where = index[hit]
            if where is not None:
                shown = " ".join(hit) if hit else text[:80]
                raise PromptOverlapError(f"training prompt {i} ({kind}, {message['role']}) overlaps "
                                         f"the held-out text in {where}: {shown!r}")
    return checked


def heldout_texts(root: str | Path | None = None) -> list[tuple[str, str]]:
    """Every evaluation text of the source tree at ``root`` (default: the tree this package
    sits in): the messages of benchmarks/prompts/*.jsonl, the strings of the OOLONG
    benchmark's modules (trajectories, few-shot turns, root prompt) and of every test module.
    Empty when the tree is not there (an installed package)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    texts: list[tuple[str, str]] = []
    for path in sorted((root / "benchmarks" / "prompts").glob("*.jsonl")):
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                for message in json.loads(line).get("messages", []):
                    texts.append((f"{path.relative_to(root)}:{line_no}", str(message.get("content", ""))))
    sources = [*sorted((root / "benchmarks" / "oolong").glob("*.py")),
               *sorted((root / "tests").rglob("*.py"))]
    for path in sources:
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 20:
                texts.append((f"{path.relative_to(root)}:{node.lineno}", node.value))
    return texts
