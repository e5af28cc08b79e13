"""A simulated sub-model: an OpenAI-compatible HTTP server on loopback that answers from `rows`.

It serves ``GET /v1/models``, ``GET /health`` and ``POST /v1/chat/completions`` (streaming and
not). The reply to a prompt is computed from the tasks' ground truth:

- a prompt holding context rows (``... Instance: <text>``) and asking *how many* of them have
  one named label gets that count;
- any other prompt holding rows gets one label per row, one per line, in the rows' order;
- a prompt without rows gets a short fixed reply.

With ``error_rate`` > 0 some rows get a wrong label (another of their task's label set); which
rows is fixed by ``seed`` and the row itself, so the same prompt always gets the same reply
(runs stay comparable). Tasks without rows cannot be simulated: `check_simulatable` refuses them.

Timing follows a continuously batching engine with chunked prefill, as vLLM schedules
(`EngineSim`, parameters in `LatencyModel`): each request first pays a fixed per-request time
(the network round trip and the serving front end), then waits for one of ``max_concurrency``
places; the engine runs steps, and each step decodes one token of every decoding stream and
spends what is left of a ``prefill_chunk_tokens`` budget on the prompts still being prefilled,
oldest first. A step lasts one decode step at the current number of decoding streams (the
per-stream speed curve) plus its prefill tokens at the prefill rate, so a prefill slows the
streams decoding beside it, and prompts queue behind the prefills ahead of them. Defaults come
from published serving measurements of 30B-class MoE models (table in ``docs/oolong.md``).

    python -m benchmarks.oolong.server --tasks tasks.jsonl [--port 8001] [--error-rate 0.05]
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import itertools
import queue
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ..openai_stub import Request, Response, StubServer
from .tasks import Task, load_tasks

MODEL_NAME = "simulated-30b-moe"
_ROW = re.compile(r"^(?:Date: (?P<date>[^|]*?) \|\| User: (?P<user>[^|]*?) \|\| )?"
                  r"Instance: (?P<instance>.*?)(?: \|\| Label: .*?)?\s*$", re.M)

DECODE_CURVE: tuple[tuple[int, float], ...] = ((1, 1.0), (10, 0.4045), (32, 0.41))
"""Per-stream decode speed relative to one stream alone, at n streams decoding:
1 stream 1.0; 10 streams 85.26 / 210.8 = 0.4045 (Millstone AI, Qwen3-Coder-Next FP8 on one
H200, 1K context: 210.8 tok/s alone, 852.6 tok/s in all at 10 concurrent requests);
32 streams 0.41 (Luminal, Qwen3.5-35B-A3B-FP8 on one H100, 1K context: 41% scaling efficiency).
Linear in between; past the last point the streams share that point's total throughput."""


@dataclass
class LatencyModel:
    """Timing of the simulated deployment (seconds; tokens at ``chars_per_token`` characters)."""

    prefill_tokens_per_s: float = 13_000.0
    """Prompt tokens prefilled per second (the engine's whole prefill capacity)."""
    ttft_overhead_s: float = 0.30
    """Fixed time every request pays before the engine sees it (serving front end, scheduling);
    requests pay it side by side, not in turn."""
    decode_tokens_per_s: float = 172.5
    """One stream's decode speed when it decodes alone."""
    decode_curve: tuple[tuple[int, float], ...] = DECODE_CURVE
    """(streams, per-stream speed relative to ``decode_tokens_per_s``) points, streams rising."""
    slowdown_per_stream: float | None = None
    """When set, replaces the curve by one slope: speed ``/ (1 + slowdown * (n - 1))``."""
    prefill_chunk_tokens: int = 8192
    """Tokens one engine step processes, decode tokens first (vLLM's max_num_batched_tokens)."""
    max_concurrency: int = 32
    """Requests in the engine at once (prefilling or decoding); more wait in a FIFO queue."""
    rtt_s: float = 0.0
    """Network round trip added to every request."""
    chars_per_token: float = 4.0

    def tokens(self, text: str) -> int:
        return max(1, round(len(text) / self.chars_per_token))

    def relative_speed(self, streams: int) -> float:
        """Per-stream decode speed at ``streams`` decoding, relative to one stream alone."""
        n = max(1, streams)
        if self.slowdown_per_stream is not None:
            return 1.0 / (1.0 + self.slowdown_per_stream * (n - 1))
        xs = [x for x, _ in self.decode_curve]
        ys = [y for _, y in self.decode_curve]
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] * xs[-1] / n
        i = bisect.bisect_right(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def stream_speed(self, streams: int) -> float:
        """Tokens per second of each of ``streams`` streams decoding together."""
        return self.decode_tokens_per_s * self.relative_speed(streams)

    def step_seconds(self, decoding: int, prefill_tokens: int) -> float:
        """One engine step: a decode step for ``decoding`` streams plus ``prefill_tokens``."""
        decode = 1.0 / self.stream_speed(decoding) if decoding else 0.0
        return decode + prefill_tokens / self.prefill_tokens_per_s

    def validate(self) -> LatencyModel:
        if self.max_concurrency < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError("--sub-max-concurrency and --sub-prefill-chunk must be >= 1")
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("sub-model speeds must be > 0")
        if min(self.ttft_overhead_s, self.rtt_s) < 0 or (self.slowdown_per_stream or 0) < 0:
            raise ValueError("sub-model overheads, round trip and slowdown must be >= 0")
        xs = [x for x, _ in self.decode_curve]
        if not xs or xs[0] != 1 or xs != sorted(set(xs)) or any(y <= 0 for _, y in self.decode_curve):
            raise ValueError("the decode curve needs points 'streams:speed' with streams rising "
                             "from 1 and speeds > 0")
        return self


# ------------------------------------------------------------------------------ the engine

@dataclass
class _Request:
    rid: int
    prompt_tokens: int
    output_tokens: int
    prefilled: int = 0
    emitted: int = 0

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prompt_tokens and self.emitted < self.output_tokens


@dataclass
class Step:
    """One engine step: how long it takes and what it produced."""

    seconds: float
    tokens: list[int] = field(default_factory=list)
    """Requests that got a token this step (the first token ends a prefill)."""
    done: list[int] = field(default_factory=list)
    """Requests finished by this step."""
    prefill_tokens: int = 0


class EngineSim:
    """Continuous batching with chunked prefill, stepped by its caller (no clock, no threads).

    Each `step` admits waiting requests up to ``max_concurrency`` (FIFO), decodes one token of
    every decoding request and gives the rest of the ``prefill_chunk_tokens`` budget to the
    requests still prefilling, in arrival order; a request whose prefill completes gets its first
    token in that step.
    """

    def __init__(self, latency: LatencyModel) -> None:
        self.latency = latency
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.peak_decoding = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, rid: int, prompt_tokens: int, output_tokens: int) -> None:
        self.waiting.append(_Request(rid, max(1, prompt_tokens), max(0, output_tokens)))

    def abort(self, rid: int) -> None:
        """Drop a request (its client went away)."""
        self.waiting = deque(r for r in self.waiting if r.rid != rid)
        self.running = [r for r in self.running if r.rid != rid]

    def step(self) -> Step:
        lat = self.latency
        while self.waiting and len(self.running) < lat.max_concurrency:
            self.running.append(self.waiting.popleft())
        decoders = [r for r in self.running if r.decoding]
        self.peak_decoding = max(self.peak_decoding, len(decoders))
        step = Step(0.0)
        budget = lat.prefill_chunk_tokens - len(decoders)
        for r in self.running:
            if budget <= 0:
                break
            if r.prefilled < r.prompt_tokens:
                take = min(budget, r.prompt_tokens - r.prefilled)
                r.prefilled += take
                budget -= take
                step.prefill_tokens += take
                if r.prefilled == r.prompt_tokens and r.output_tokens:
                    r.emitted = 1
                    step.tokens.append(r.rid)
        for r in decoders:
            r.emitted += 1
            step.tokens.append(r.rid)
        step.seconds = lat.step_seconds(len(decoders), step.prefill_tokens)
        for r in list(self.running):
            if r.prefilled == r.prompt_tokens and r.emitted >= r.output_tokens:
                self.running.remove(r)
                step.done.append(r.rid)
        return step


def simulate(latency: LatencyModel, requests: Sequence[tuple[float, int, int]],
             ) -> list[tuple[float, float]]:
    """Run `EngineSim` on virtual time: ``requests`` are (arrival s, prompt tokens, output
    tokens); returns each one's (time to first token, end-to-end time), as the server would
    take them (per-request overhead and round trip included)."""
    sim = EngineSim(latency)
    fixed = latency.ttft_overhead_s + latency.rtt_s
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    clock = 0.0
    while pending or sim.busy:
        while pending and requests[pending[0]][0] + fixed <= clock:
            i = pending.pop(0)
            sim.submit(i, requests[i][1], requests[i][2])
        if not sim.busy:
            clock = requests[pending[0]][0] + fixed
            continue
        step = sim.step()
        clock += step.seconds
        for rid in step.tokens:
            first.setdefault(rid, clock)
        for rid in step.done:
            first.setdefault(rid, clock)
            end[rid] = clock
    return [(first[i] - requests[i][0], end[i] - requests[i][0]) for i in range(len(requests))]


class _EngineLoop:
    """Runs an `EngineSim` in real time on one thread; requests wait on their own queues."""

    def __init__(self, latency: LatencyModel) -> None:
        self.sim = EngineSim(latency)
        self._cond = threading.Condition()
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="sim-engine")
        self._thread.start()

    def submit(self, prompt_tokens: int, output_tokens: int) -> tuple[int, queue.SimpleQueue]:
        with self._cond:
            rid = next(self._ids)
            events: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[rid] = events
            self.sim.submit(rid, prompt_tokens, output_tokens)
            self._cond.notify()
        return rid, events

    def abort(self, rid: int) -> None:
        with self._cond:
            self.sim.abort(rid)
            self._queues.pop(rid, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        due: float | None = None
        while True:
            with self._cond:
                while not self.sim.busy and not self._stopped:
                    due = None
                    self._cond.wait()
                if self._stopped:
                    return
                step = self.sim.step()
            now = time.monotonic()
            due = (due if due is not None else now) + step.seconds
            if due > now:
                time.sleep(due - now)
            with self._cond:
                for rid in step.tokens:
                    if rid in self._queues:
                        self._queues[rid].put("token")
                for rid in step.done:
                    if rid in self._queues:
                        self._queues.pop(rid).put("done")


# ------------------------------------------------------------------------------ answers

@dataclass
class Oracle:
    """Answers the agent's prompts from the rows' labels."""

    labels: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    """instance text -> (its label, its task's label set)"""
    error_rate: float = 0.0
    seed: int = 0

    @classmethod
    def from_tasks(cls, tasks: Iterable[Task], error_rate: float = 0.0, seed: int = 0) -> Oracle:
        labels: dict[str, tuple[str, tuple[str, ...]]] = {}
        for t in tasks:
            label_set = tuple(t.labels)
            for _date, _user, instance, label in t.rows:
                labels[instance.strip()] = (label, label_set)
        return cls(labels, error_rate, seed)

    @cached_property
    def label_names(self) -> list[str]:
        """Every label of every task's label set."""
        return sorted({lab for _, label_set in self.labels.values() for lab in label_set})

    def label(self, date: str, user: str, instance: str) -> str:
        truth, label_set = self.labels.get(instance.strip(), ("unknown", ()))
        if self.error_rate <= 0 or truth == "unknown":
            return truth
        digest = hashlib.sha256(f"{self.seed}|{date}|{user}|{instance.strip()}".encode()).digest()
        if int.from_bytes(digest[:4], "big") / 2**32 >= self.error_rate:
            return truth
        others = [lab for lab in label_set if lab != truth]
        return others[digest[4] % len(others)] if others else truth

    def reply(self, prompt: str) -> str:
        rows = [(m["date"] or "", m["user"] or "", m["instance"]) for m in _ROW.finditer(prompt)]
        if not rows:
            return "There are no questions in this message to classify."
        labels = [self.label(*r) for r in rows]
        instruction = _ROW.sub("", prompt).lower()
        named = [lab for lab in self.label_names if re.search(
            rf"(?<![\w-]){re.escape(lab.lower())}(?![\w-])", instruction)]
        if "how many" in instruction and len(named) == 1:
            return str(sum(lab == named[0] for lab in labels))
        return "\n".join(labels)


def check_simulatable(tasks: Sequence[Task]) -> None:
    """Raise ``ValueError`` naming the tasks that have no ``rows``: the simulated sub-model has
    nothing to answer them from, and a real model must be used instead."""
    missing = [t.id for t in tasks if not t.rows]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(
            f"{len(missing)} of {len(tasks)} tasks have no 'rows' (the labelled rows the "
            f"simulated sub-model answers from): {shown}. Pass --sub-base-url URL to send "
            "llm_query to a real OpenAI-compatible model instead.")


class SimulatedSubModel(StubServer):
    """The server: ``with SimulatedSubModel(oracle) as s: s.url`` (``http://127.0.0.1:port``);
    `benchmarks.openai_stub.StubServer` with the answers of `serve`."""

    def __init__(self, oracle: Oracle, latency: LatencyModel | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.oracle = oracle
        self.latency = (latency or LatencyModel()).validate()
        self._engine = _EngineLoop(self.latency)
        super().__init__(model=MODEL_NAME, models=[MODEL_NAME], host=host, port=port, record=False)

    @property
    def peak_decoding(self) -> int:
        """The most streams that decoded in one step."""
        return self._engine.sim.peak_decoding

    def stop(self) -> None:
        super().stop()
        self._engine.stop()

    # -- serving one request -------------------------------------------------------------------

    def serve(self, prompt: str, max_tokens: int | None,
              emit: Callable[[str], None]) -> tuple[int, int, str]:
        """Pay the fixed per-request time, go through the engine, ``emit(piece)`` each token.

        Returns (prompt_tokens, completion_tokens, finish_reason).
        """
        lat = self.latency
        text = self.oracle.reply(prompt)
        size = int(lat.chars_per_token)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        finish = "stop"
        if max_tokens is not None and len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        prompt_tokens = lat.tokens(prompt)
        time.sleep(lat.rtt_s + lat.ttft_overhead_s)
        rid, events = self._engine.submit(prompt_tokens, len(pieces))
        sent = 0
        try:
            while events.get() == "token":
                emit(pieces[sent])
                sent += 1
        except BaseException:
            self._engine.abort(rid)
            raise
        return prompt_tokens, sent, finish

    def respond(self, request: Request, response: Response) -> None:
        """Stream the reply of `serve` (usage included), or send it whole."""
        prompt = request.prompt()
        max_tokens = request.body.get("max_tokens") or request.body.get("max_completion_tokens")
        if request.stream:
            response.open_stream()
            p, c, finish = self.serve(prompt, max_tokens, response.piece)
            response.finish(finish)
            response.usage(p, c)
            response.close_stream()
        else:
            parts: list[str] = []
            p, c, finish = self.serve(prompt, max_tokens, parts.append)
            response.complete("".join(parts), finish, p, c)


def _curve(text: str) -> tuple[tuple[int, float], ...]:
    try:
        points = tuple((int(n), float(v)) for n, v in (p.split(":") for p in text.split(",") if p))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad decode curve {text!r}: use streams:relative_speed pairs, e.g. "
            "1:1,10:0.4045,32:0.41") from None
    return points


def _optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none") else float(text)


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    """The simulated sub-model's timing options (``--sub-*``); `latency_from_args` reads them."""
    d = LatencyModel()
    p.add_argument("--sub-prefill-tps", type=float, default=d.prefill_tokens_per_s,
                   help="prompt tokens prefilled per second")
    p.add_argument("--sub-ttft-overhead-ms", type=float, default=d.ttft_overhead_s * 1000,
                   help="fixed time per request before the engine sees it")
    p.add_argument("--sub-decode-tps", type=float, default=d.decode_tokens_per_s,
                   help="one stream's decode speed alone")
    p.add_argument("--sub-decode-curve", type=_curve, default=d.decode_curve,
                   help="per-stream speed relative to one stream, as streams:speed pairs "
                        "(default 1:1,10:0.4045,32:0.41, the cited reports)")
    p.add_argument("--sub-slowdown", type=_optional_float, default=None,
                   help="replace the curve by one slope: speed / (1 + S (n - 1))")
    p.add_argument("--sub-prefill-chunk", type=int, default=d.prefill_chunk_tokens,
                   help="tokens per engine step (vLLM's max_num_batched_tokens)")
    p.add_argument("--sub-max-concurrency", type=int, default=d.max_concurrency,
                   help="requests in the engine at once; more queue")
    p.add_argument("--sub-rtt-ms", type=float, default=d.rtt_s * 1000,
                   help="network round trip added to every request")


def latency_from_args(args: argparse.Namespace) -> LatencyModel:
    """The `LatencyModel` the ``--sub-*`` options describe; ``ValueError`` naming a bad one."""
    return LatencyModel(
        prefill_tokens_per_s=args.sub_prefill_tps, ttft_overhead_s=args.sub_ttft_overhead_ms / 1000,
        decode_tokens_per_s=args.sub_decode_tps, decode_curve=tuple(args.sub_decode_curve),
        slowdown_per_stream=args.sub_slowdown, prefill_chunk_tokens=args.sub_prefill_chunk,
        max_concurrency=args.sub_max_concurrency, rtt_s=args.sub_rtt_ms / 1000,
    ).validate()


def latency_cli_args(args: argparse.Namespace) -> list[str]:
    """The ``--sub-*`` options of ``args`` as command-line arguments for this server."""
    lat = latency_from_args(args)
    out = ["--sub-prefill-tps", str(lat.prefill_tokens_per_s),
           "--sub-ttft-overhead-ms", str(lat.ttft_overhead_s * 1000),
           "--sub-decode-tps", str(lat.decode_tokens_per_s),
           "--sub-decode-curve", ",".join(f"{n}:{v}" for n, v in lat.decode_curve),
           "--sub-prefill-chunk", str(lat.prefill_chunk_tokens),
           "--sub-max-concurrency", str(lat.max_concurrency),
           "--sub-rtt-ms", str(lat.rtt_s * 1000)]
    if lat.slowdown_per_stream is not None:
        out += ["--sub-slowdown", str(lat.slowdown_per_stream)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.oolong.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", required=True, help="JSONL task file whose rows hold the labels")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    add_latency_arguments(p)
    args = p.parse_args(argv)
    try:
        if not 0.0 <= args.error_rate <= 1.0:
            raise ValueError("--error-rate must be within [0, 1]")
        tasks = load_tasks(args.tasks)
        check_simulatable(tasks)
        oracle = Oracle.from_tasks(tasks, args.error_rate, args.seed)
        latency = latency_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = SimulatedSubModel(oracle, latency, args.host, args.port)
    print(f"listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
