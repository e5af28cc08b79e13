"""The local model store: pull (once per machine, cached), list, resolve, and its errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from agentrt.engine import models
from agentrt.engine.models import CorruptModelError, ModelNotFoundError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_tiny_model(path: Path, model_type: str = "llama", vocab_size: int = 512) -> Path:
    """Save a small random-init Hugging Face causal LM (no tokenizer) to ``path``."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[model_type]
    config = config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pulled() -> dict[str, Path]:
    return models.pull("smollm2-135m", dtypes=("bf16", "fp32"), progress=False)


def test_pull_is_cached_and_listed(pulled):
    weights = pulled["bf16"] / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = models.pull("smollm2-135m", dtypes=("bf16", "fp32"), progress=False)
    assert again == pulled
    assert weights.stat().st_mtime_ns == mtime, "an up-to-date pull must not rewrite the weights"

    infos = {(i.name, i.dtype): i for i in models.list_models()}
    # bf16 keeps the GGUF blocks too (0.72 bytes per weight, see agentrt.engine.packed)
    for dtype, expected_bytes in (("bf16", 2.72 * 134_000_000), ("fp32", 4 * 134_000_000)):
        info = infos[("smollm2-135m", dtype)]
        assert info.ok, info.error
        assert info.path == pulled[dtype]
        assert 0.95 * expected_bytes < info.size < 1.1 * expected_bytes

    manifest = json.loads((pulled["bf16"] / models.MANIFEST).read_text())
    assert manifest["source"]["gguf_sha256"] == models.REGISTRY["smollm2-135m"].gguf_sha256
    assert manifest["files"]["model.safetensors"]["sha256"] == models.sha256_file(weights)
    assert "packed/gguf-blocks.safetensors" in manifest["files"]
    config = json.loads((pulled["bf16"] / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"


def test_resolve_and_ensure_find_pulled_model(pulled):
    assert models.resolve("smollm2-135m", "bf16") == pulled["bf16"]
    assert models.resolve("smollm2-135m", "float32") == pulled["fp32"]
    assert models.ensure("smollm2-135m", "bf16") == pulled["bf16"]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_resolve_plain_hf_directory(tmp_path, model_type):
    path = make_tiny_model(tmp_path / model_type, model_type)
    assert models.resolve(path) == path
    assert models.resolve(str(path), "fp32") == path


def test_resolve_rejects_unsupported_directories(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        models.resolve(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelNotFoundError, match="not supported"):
        models.resolve(tmp_path)


def test_missing_model_says_how_to_pull(tmp_path):
    with pytest.raises(ModelNotFoundError, match="agentrt models pull smollm2-135m"):
        models.resolve("smollm2-135m", "bf16", cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="neither a local model directory"):
        models.resolve("no-such-model")
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        models.pull("no-such-model", cache_dir=tmp_path)
    assert models.list_models(cache_dir=tmp_path) == []


def test_corrupt_model_is_detected(tmp_path):
    target = models.model_dir("smollm2-135m", "bf16", cache_dir=tmp_path)
    make_tiny_model(target)
    models.write_manifest(target, "smollm2-135m", "bf16")
    assert models.resolve("smollm2-135m", "bf16", cache_dir=tmp_path) == target

    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))
    with pytest.raises(CorruptModelError, match="checksum mismatch"):
        models.resolve("smollm2-135m", "bf16", cache_dir=tmp_path)
    [info] = models.list_models(cache_dir=tmp_path)
    assert not info.ok and "model.safetensors" in info.error

    (target / "config.json").unlink()
    with pytest.raises(CorruptModelError, match="config.json is missing"):
        models.verify(target)


def test_pull_refuses_a_gguf_with_the_wrong_checksum(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 1000)
    with pytest.raises(CorruptModelError, match="expected"):
        models.pull("smollm2-135m", dtypes=("bf16",), cache_dir=tmp_path / "home",
                    progress=False, gguf_path=fake)
    assert not models.model_dir("smollm2-135m", "bf16", tmp_path / "home").exists()
    assert not models.gguf_file_path("smollm2-135m", tmp_path / "home").exists()


def test_gguf_file_is_verified_and_kept(tmp_path):
    """The GGUF other engines read (llama.cpp in the benchmark): a corrupt copy is replaced by
    a verified download, which is then kept and reused as it is."""
    target = models.gguf_file_path("smollm2-135m", tmp_path)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + b"\0" * 1000)
    path = models.gguf_file("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert path == target
    assert models.sha256_file(path) == models.REGISTRY["smollm2-135m"].gguf_sha256
    mtime = path.stat().st_mtime_ns
    assert models.gguf_file("smollm2-135m", cache_dir=tmp_path, progress=False) == path
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        models.gguf_file("nope", cache_dir=tmp_path)


def test_home_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(models.HOME_ENV, str(tmp_path))
    assert models.home() == tmp_path
    assert models.model_dir("smollm2-135m", "bfloat16") == tmp_path / "models" / "smollm2-135m" / "bf16"
    with pytest.raises(ValueError, match="unknown dtype"):
        models.normalize_dtype("int3")
    shutil.rmtree(tmp_path, ignore_errors=True)
