"""The program-shape suite: scripted agent responses that exercise tool speculation.

Each `Pattern` is a multi-turn scripted model (one response per turn), a context, and tools with a
set latency. Tool results are deterministic functions of their arguments, so a speculative run
must reproduce the sequential run exactly (answer, printed output, errors).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import anyio

from agentrt import Tool, tool


def _h(*parts: Any) -> int:
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16)


def make_tools(latency: float) -> dict[str, Tool]:
    """The pattern tools; each sleeps for its latency (a multiple of ``latency``)."""

    @tool(speculate=True, pure=True)
    async def summarize(doc: str) -> str:
        """A one-line summary of a document."""
        await anyio.sleep(latency)
        return f"summary-{_h('s', doc) % 1000}"

    @tool(speculate=True, pure=True)
    async def score(text: str) -> int:
        """A relevance score 0..99."""
        await anyio.sleep(latency)
        return _h("score", text) % 100

    @tool(speculate=True, pure=True)
    async def extract(item: str) -> str:
        """The key fact of an item."""
        await anyio.sleep(latency)
        return f"fact-{_h('e', item) % 1000}"

    @tool(speculate=True, pure=True)
    async def classify(fact: str) -> str:
        """A label for a fact."""
        await anyio.sleep(latency)
        return ["red", "green", "blue"][_h("c", fact) % 3]

    @tool(speculate=True, pure=True)
    async def step(x: int) -> int:
        """One step of an iterative computation."""
        await anyio.sleep(latency)
        return (x * 31 + 7) % 1009

    @tool(speculate=True, pure=True)
    async def llm_vote(question: str) -> str:
        """A (deterministic) vote."""
        await anyio.sleep(latency * 1.5)
        return ["yes", "no"][_h("v", question) % 2]

    @tool(speculate=True, pure=True)
    async def combine(text: str) -> str:
        """Merge summaries into one report."""
        await anyio.sleep(latency * 2)
        return f"report-{_h('r', text) % 10000}"

    @tool(speculate=True, pure=True)
    async def count_pages(doc: str) -> int:
        """Page count of a document (1..6)."""
        await anyio.sleep(latency * 0.5)
        return 1 + _h("p", doc) % 6

    @tool(speculate=True, pure=True)
    async def fetch_page(doc: str, page: int) -> str:
        """The text of one page."""
        await anyio.sleep(latency)
        return f"{doc}/p{page}"

    @tool(speculate=True, pure=True)
    async def neighbors(node: str) -> list[str]:
        """Graph neighbours of a node."""
        await anyio.sleep(latency * 0.5)
        n = int(node[1:])
        return [f"n{(n * 3 + 1) % 11}", f"n{(n * 5 + 2) % 11}"] if n < 9 else []

    saved: list[str] = []

    @tool(writes={"notes"})  # effectful: never speculated
    async def save_note(text: str) -> int:
        """Store a note; returns its id."""
        await anyio.sleep(latency * 0.5)
        saved.append(text)
        return len(saved)

    @tool(speculate=True, reads={"notes"})  # waits for save_note: reads never overtake writes
    async def count_notes() -> int:
        """How many notes are stored."""
        await anyio.sleep(latency * 0.5)
        return len(saved)

    @tool(speculate=True, pure=True)
    async def mentions(doc: str, word: str) -> bool:
        """Whether a document mentions a word (doc5 and later mention "budget")."""
        await anyio.sleep(latency * 0.5)
        return word == "budget" and int(doc[3:]) >= 5

    return {t.name: t for t in (summarize, score, extract, classify, step, llm_vote, combine,
                                count_pages, fetch_page, neighbors, save_note, count_notes,
                                mentions)}


def fence(code: str) -> str:
    return f"```repl\n{code.strip()}\n```"


DOCS = [f"doc{i}" for i in range(16)]
PROSE = (
    "Let me think about how to approach this. The context holds a list of documents; I will "
    "process them with the tools, keep intermediate results in variables, and only print what "
    "I need to check. "
)


@dataclass
class Pattern:
    name: str
    responses: list[str]
    context: Any = None
    tools: tuple[str, ...] = ()
    note: str = ""
    extra: dict = field(default_factory=dict)


def patterns() -> list[Pattern]:
    """The suite, in a fixed order."""
    P = Pattern
    return [
        P("independent_map", [
            "I'll summarise every document.\n" + fence("""
summaries = []
for doc in context:
    summaries.append(summarize(doc))
print(len(summaries), summaries[0])
"""), fence("FINAL(summaries[-1])")], DOCS, ("summarize",), "16 independent calls"),
        P("map_reduce", [fence("""
parts = [summarize(d) for d in context[:8]]
report = combine("\\n".join(parts))
print(report)
FINAL(report)
""")], DOCS, ("summarize", "combine"), "8 map calls then one reduce"),
        P("two_stage_chain", [fence("""
labels = {}
for item in context[:6]:
    fact = extract(item)
    labels[item] = classify(fact)
print(sorted(labels.items()))
FINAL(labels)
""")], DOCS, ("extract", "classify"), "extract -> classify per item"),
        P("serial_chain", [fence("""
x = 1
x = step(x)
x = step(x)
x = step(x)
x = step(x)
print("x =", x)
FINAL(x)
""")], None, ("step",), "each call needs the previous result"),
        P("branch_on_result", [fence("""
s = score(context[0])
if s % 2 == 0:
    detail = summarize(context[1])
else:
    detail = extract(context[2])
other = summarize(context[3])
print(s, detail, other)
FINAL([s, detail, other])
""")], DOCS, ("score", "summarize", "extract"), "score(x) % 2 decides the next call"),
        P("early_break", [fence("""
found = None
for doc in context:
    if score(doc) > 80:
        found = doc
        break
print("found", found)
FINAL(found)
""")], DOCS, ("score",), "sequential probe with break"),
        P("mutating_iterable", [fence("""
queue = ["n1"]
seen = set()
while queue:
    node = queue.pop(0)
    if node in seen:
        continue
    seen.add(node)
    queue.extend(neighbors(node))
print(sorted(seen))
FINAL(len(seen))
""")], None, ("neighbors",), "BFS: the loop extends its own queue"),
        P("identical_votes", [fence("""
from collections import Counter
votes = [llm_vote("Is the report consistent?") for _ in range(5)]
winner = Counter(votes).most_common(1)[0][0]
print(votes, winner)
FINAL(winner)
""")], None, ("llm_vote",), "5 identical calls = 5 invocations"),
        P("crash_after_calls", [fence("""
a = summarize(context[0])
b = summarize(context[1])
ratio = len(a) / (len(b) - len(b))
"""), "The division failed; fall back.\n" + fence("FINAL([a, b])")],
          DOCS, ("summarize",), "ZeroDivisionError right after two calls"),
        P("effectful_mid_block", [fence("""
first = summarize(context[0])
note_id = save_note(first)
second = summarize(context[1])
third = summarize(context[2])
print(note_id, second, third)
FINAL([note_id, first, second, third])
""")], DOCS, ("summarize", "save_note"), "a non-speculatable call between pure ones"),
        P("computed_while", [fence("""
pages = count_pages(context[0])
texts = []
i = 1
while i <= pages:
    texts.append(fetch_page(context[0], i))
    i += 1
print(pages, texts[-1])
FINAL(texts)
""")], DOCS, ("count_pages", "fetch_page"), "loop bound comes from a call"),
        P("comprehensions", [fence("""
scores = {d: score(d) for d in context[:8]}
top = [d for d in context[:8] if scores[d] > 40]
facts = [extract(d) for d in top]
print(top, facts)
FINAL(facts)
""")], DOCS, ("score", "extract"), "dict comprehension, filter, list comprehension"),
        P("decorated_helper", [fence("""
import functools

@functools.lru_cache(maxsize=None)
def label(item):
    return classify(extract(item))

labels = [label(d) for d in context[:5]]
print(labels)
FINAL(labels)
""")], DOCS, ("extract", "classify"), "a cached helper function calling two tools"),
        P("several_blocks", [
            "First the summaries.\n" + fence("""
sums = [summarize(d) for d in context[:4]]
""") + "\nNow the scores of those summaries.\n" + fence("""
ranked = sorted(sums, key=lambda s: score(s))
print(ranked[0])
FINAL(ranked)
""")], DOCS, ("summarize", "score"), "two blocks in one response, the 2nd uses the 1st"),
        P("two_turn_dependency", [
            fence("""
facts = [extract(d) for d in context[:4]]
print(facts)
"""),
            "Now classify what I extracted.\n" + fence("""
labels = [classify(f) for f in facts]
FINAL(labels)
""")], DOCS, ("extract", "classify"), "turn 2 speculates from the namespace turn 1 left"),
        P("long_prose", [
            PROSE * 3 + "\n" + fence("""
a = summarize(context[5])
b = summarize(context[6])
""") + "\n" + PROSE * 3 + "\nThat is the plan.\n",
            fence("FINAL(a + ' ' + b)")], DOCS, ("summarize",), "prose before and after the block"),
        # shapes that used to waste early calls or break the effect order
        P("while_update_last", [fence("""
i = 0
scores = []
while i < 6:
    scores.append(score(context[i]))
    i += 1
print(scores)
FINAL(scores)
""")], DOCS, ("score",), "while loop whose i += 1 streams after the call"),
        P("first_match", [fence("""
hit = None
for doc in context:
    if mentions(doc, "budget"):
        hit = doc
        break
print("first", hit)
FINAL(hit)
""")], DOCS, ("mentions",), "stop at the first matching result of 16"),
        P("read_after_write", [fence("""
before = count_notes()
note = save_note(summarize(context[0]))
after = count_notes()
other = summarize(context[1])
print(before, note, after, other)
FINAL([before, note, after, other])
""")], DOCS, ("count_notes", "save_note", "summarize"), "a read of what an effect wrote"),
    ]


def tool_list(pattern: Pattern, latency: float) -> list[Tool]:
    tools = make_tools(latency)
    return [tools[name] for name in pattern.tools]

