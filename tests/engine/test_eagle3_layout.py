"""The EAGLE-3 head directory (`engine/eagle3_layout.py`): written from a state dict, checked
against the target, and refused with every problem named; `VLLMEngine`'s speculative config
checks an ``eagle3`` head before vLLM starts. vLLM itself loads and runs the head in
tests/engine/test_vllm_engine.py (vllm-marked)."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_heads import random_head
from safetensors.torch import load_file, save_file

from agentrt.engine import EngineError, models
from agentrt.engine.eagle3_layout import (
    HeadLayoutError, check_head, default_aux_layers, head_config, target_config, tensor_shapes,
    vocab_maps, write_head)
from agentrt.engine.vllm_engine import VLLMServer, checked_speculative_config


@pytest.fixture(scope="module")
def target_dir() -> str:
    return str(models.ensure("smollm2-135m", dtype="fp32"))


@pytest.fixture(scope="module")
def head(target_dir, tmp_path_factory):
    return random_head(tmp_path_factory.mktemp("eagle") / "eagle", target_dir)


def _edit_weights(head_dir, edit) -> None:
    path = head_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _copy(head, tmp_path):
    copy = tmp_path / "head"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((head / name).read_bytes())
    return copy


def test_a_head_for_smollm2_has_the_layout_vllm_loads(head, target_dir):
    config = check_head(head, target_dir)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["hidden_size"], config["target_hidden_size"], config["vocab_size"]) == (
        576, 576, 49152)
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 4096
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is False
    assert config["agentrt"]["target"] == "smollm2-135m"
    assert config["agentrt"]["format_version"] == 1
    tensors = load_file(str(head / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors
    assert tensors["fc.weight"].shape == (576, 3 * 576)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (9 * 64, 2 * 576)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (3 * 64, 2 * 576)
    assert tensors["lm_head.weight"].shape == (4096, 576)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 4096
    target_ids = torch.arange(4096) + d2t
    assert bool(t2d[target_ids].all())


def test_vocab_maps_round_trip():
    ids = torch.tensor([0, 5, 6, 40])
    d2t, t2d = vocab_maps(ids, 50)
    assert d2t.tolist() == [0, 4, 4, 37]
    assert torch.nonzero(t2d).flatten().tolist() == [0, 5, 6, 40]
    assert default_aux_layers(30) == [2, 15, 27]


def test_a_head_for_another_target_is_refused_naming_both(head, target_dir):
    other = target_config(target_dir) | {"hidden_size": 960, "vocab_size": 49280}
    with pytest.raises(HeadLayoutError) as info:
        check_head(head, other)
    message = str(info.value)
    assert "hidden size 576 (smollm2-135m), this target's is 960" in message
    assert "vocabulary of 49152 (smollm2-135m), this target's is 49280" in message
    assert isinstance(info.value, EngineError) and isinstance(info.value, ValueError)


def test_config_problems_are_all_named(head, target_dir, tmp_path):
    bad = _copy(head, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    config["num_hidden_layers"] = 2
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 30]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadLayoutError) as info:
        check_head(bad, target_dir)
    assert str(bad) in str(info.value)
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert "'LlamaForCausalLMEagle3'" in problems[0]
    assert "num_hidden_layers is 2" in problems[1]
    assert "[2, 15, 30] must be 3 layer indices of the target's 30 layers" in problems[2]

    del config["draft_vocab_size"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadLayoutError, match="config.json lacks draft_vocab_size"):
        check_head(bad, target_dir)


def test_tensor_problems_are_all_named(head, target_dir, tmp_path):
    bad = _copy(head, tmp_path)

    def edit(tensors):
        del tensors["midlayer.hidden_norm.weight"]
        tensors["embed_tokens.weight"] = torch.zeros(4, 576)
        tensors["fc.weight"] = torch.zeros(576, 576)
        tensors["d2t"] = tensors["d2t"].to(torch.int32)
    _edit_weights(bad, edit)
    with pytest.raises(HeadLayoutError) as info:
        check_head(bad, target_dir)
    assert info.value.problems == [
        "missing tensors midlayer.hidden_norm.weight",
        "unexpected tensors embed_tokens.weight",
        "fc.weight has shape [576, 576], expected [576, 1728]",
        "d2t is torch.int32, expected torch.int64",
    ]


def test_d2t_and_t2d_must_agree(head, target_dir, tmp_path):
    bad = _copy(head, tmp_path)

    def edit(tensors):
        tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    _edit_weights(bad, edit)
    with pytest.raises(HeadLayoutError, match="t2d marks 4096 target ids, d2t maps to 4096 others"):
        check_head(bad, target_dir)

    def beyond(tensors):
        tensors["d2t"][-1] = 49152
    _edit_weights(bad, beyond)
    with pytest.raises(HeadLayoutError, match=r"outside 0\.\.49151"):
        check_head(bad, target_dir)


def test_missing_files_and_bad_tensors_are_refused(target_dir, tmp_path):
    with pytest.raises(HeadLayoutError, match="missing config.json, model.safetensors"):
        check_head(tmp_path, target_dir)
    config = head_config(target_config(target_dir), draft_vocab_size=8, target_name="smollm2-135m")
    tensors = {name: torch.zeros(shape) for name, shape in tensor_shapes(config).items()}
    tensors["d2t"], tensors["t2d"] = vocab_maps(torch.arange(8), 49152)
    tensors["lm_head.weight"] = torch.zeros(9, 576)
    with pytest.raises(HeadLayoutError, match=r"lm_head.weight has shape \[9, 576\], expected \[8, 576\]"):
        write_head(tmp_path / "out", config, tensors)
    assert not (tmp_path / "out").exists()


def test_vllm_configs_check_an_eagle3_head_before_vllm_starts(head, target_dir, tmp_path):
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    assert checked_speculative_config(config, target_dir) == config
    server = VLLMServer(target_dir, speculative_config=config)
    spec = json.loads(server.command()[server.command().index("--speculative-config") + 1])
    assert spec == config

    other = tmp_path / "other"
    (other / "fp32").mkdir(parents=True)
    (other / "fp32" / "config.json").write_text(json.dumps(
        target_config(target_dir) | {"vocab_size": 32000}))
    with pytest.raises(HeadLayoutError, match="this target's is 32000"):
        VLLMServer(str(other / "fp32"), speculative_config=config)
    # no head named: the one next to the pulled weights, else a clear error
    same = tmp_path / "same"
    (same / "fp32").mkdir(parents=True)
    (same / "fp32" / "config.json").write_text(json.dumps(target_config(target_dir)))
    with pytest.raises(EngineError, match="names no head and .*drafters/eagle does not exist"):
        checked_speculative_config({"method": "eagle3"}, str(same / "fp32"))
    (same / "drafters").mkdir()
    (same / "drafters" / "eagle").symlink_to(head)
    found = checked_speculative_config({"method": "eagle3"}, str(same / "fp32"))
    assert found["model"] == str(same / "drafters" / "eagle")
    with pytest.raises(EngineError, match="eagle3 head directory .*/nowhere does not exist"):
        checked_speculative_config({"method": "eagle3", "model": str(tmp_path / "nowhere")},
                                   target_dir)
    hub = {"method": "eagle3", "model": "someone/EAGLE3-head"}  # for vLLM to resolve
    assert checked_speculative_config(hub, target_dir) == hub
    # other methods pass through untouched
    assert checked_speculative_config({"method": "ngram", "model": "x"}, target_dir) == {
        "method": "ngram", "model": "x"}
