"""The chain-or-tree estimate: acceptance by shape from teacher-forced ranks, the teacher-forced
head equal to the engine's own drafter along the same path, and the speedup arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from agentrt.engine import models
from agentrt.engine.drafters.eagle import EagleDrafter
from agentrt.engine.eagle import DraftHead
from agentrt.engine.eagle.data import record_features
from agentrt.engine.llama import Transformer
from benchmarks.tree_drafts import (accepted_lengths, estimate, head_topk, nodes_per_depth,
                                    perfect_chains, ranks_along)


def test_a_tree_accepts_a_depth_when_the_token_is_within_its_width():
    ranks = torch.tensor([[0, 0, 0, 0],    # the chain's path all along
                          [1, 0, 0, 0],    # second choice first, then the head's top
                          [0, 2, 0, 0],    # third choice at depth 1
                          [0, 0, -1, -1],  # the reply ends after two tokens
                          [5, 0, 0, 0]])   # not in any top-4
    assert accepted_lengths(ranks, (1, 1, 1, 1)).tolist() == [4, 0, 1, 2, 0]
    assert accepted_lengths(ranks, (2, 1, 1, 1)).tolist() == [4, 4, 1, 2, 0]
    assert accepted_lengths(ranks, (3, 3, 1, 1)).tolist() == [4, 4, 4, 2, 0]
    assert accepted_lengths(ranks, (1, 1)).tolist() == [2, 0, 1, 2, 0]
    assert nodes_per_depth((3, 2, 1, 1)) == [3, 6, 6, 6]


def test_speedup_counts_the_verify_forward_over_every_node_and_each_head_step():
    ranks = torch.zeros(10, 4, dtype=torch.long)  # every draft accepted
    verify = {1: 10.0, 3: 12.0, 5: 20.0, 9: 30.0}
    head = {1: 1.0, 2: 1.5}
    verify[7] = 25.0
    chain2, tree = estimate(ranks, verify, head, [(1, 1), (2, 2)])
    assert chain2.nodes == 2 and chain2.mean_accepted == 2
    assert chain2.speedup == 3 * 10.0 / (12.0 + 1.0 + 1.0)
    assert tree.nodes == 6 and tree.speedup == 3 * 10.0 / (25.0 + 1.0 + 1.5)


def test_the_perfect_chain_bound_charges_the_verify_forward_and_a_head_step_per_token():
    verify = {1: 10.0, 2: 11.0, 5: 20.0}
    assert perfect_chains(verify, 1.0) == [(1, 2 * 10.0 / (11.0 + 1.0), 2 * 10.0 / 11.0),
                                           (4, 5 * 10.0 / (20.0 + 4.0), 5 * 10.0 / 20.0)]


def test_teacher_forced_drafts_are_the_engines_chain_along_the_same_path(tmp_path):
    """Along the head's own chain, `head_topk`'s top choice at every depth is the token the
    engine's drafter drafts there (a random head: any indexing slip shows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eagle3_heads import random_head

    target_dir = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(target_dir, "bf16")
    head = DraftHead.load(random_head(tmp_path / "head", target_dir, draft_vocab_size=2048, seed=3))
    drafter = EagleDrafter(head, model.embed.detach(), weights_dtype=None)  # float32, as head_topk
    depth = 5
    prompt = list(range(500, 540))
    for anchor in (len(prompt) - 1, len(prompt) + 1):
        known = prompt + [1234, 77, 4321][:anchor + 2 - len(prompt)]  # to the token after the anchor
        features, _ = record_features(model, known, head.config.aux_layers)
        state = drafter.begin(known)
        state.add_features(0, features[:anchor + 1])
        chain = state.draft(depth).tokens
        assert len(chain) == depth
        path = torch.tensor(known + chain)
        padded = torch.cat([features[:anchor + 1], torch.zeros(depth, features.shape[1], dtype=features.dtype)])
        top = head_topk(head, model.embed.detach(), path, padded[:path.numel() - 1], anchor + 1, depth, 2)
        assert top[0, :, 0].tolist() == chain
        assert ranks_along(top, path, anchor + 1)[0].tolist() == [0] * depth
