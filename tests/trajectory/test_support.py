"""The sampling support replayed on logits (trajectory/support.py), on hand-computed rows; that it matches the
engine's own masks token for token is tests/grpo/test_policy.py's real-engine check."""

import math

import pytest
import torch

from polar_lab.trajectory.support import restrict, support

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax 0.6439, 0.2369, 0.0871, 0.0321


def kept(top_k=-1, top_p=1.0, min_p=0.0, logits=LOGITS):
    out = restrict(logits.clone(), torch.tensor([[float(top_k), top_p, min_p]]))
    return [int(i) for i in torch.isfinite(out[0]).nonzero().flatten()]


@pytest.mark.parametrize("knobs,expected", [
    ({}, [0, 1, 2, 3]),                     # nothing off
    ({"top_k": 2}, [0, 1]),
    ({"top_k": 9}, [0, 1, 2, 3]),           # beyond the vocabulary: all
    ({"top_p": 0.8}, [0, 1]),               # 0.6439 + 0.2369 = 0.8808 ≥ 0.8: the smallest such set
    ({"top_p": 0.9}, [0, 1, 2]),            # needs the third: 0.9679
    ({"top_p": 0.5}, [0]),                  # at least one, the largest
    ({"min_p": 0.2}, [0, 1]),               # p ≥ 0.2 · 0.6439 = 0.1288
    ({"min_p": 0.1}, [0, 1, 2]),            # p ≥ 0.0644
    # top_k before top_p: over the top 3 renormalised (0.6652, 0.2447, 0.0900), 0.9 is reached by two
    ({"top_k": 3, "top_p": 0.9}, [0, 1]),
])
def test_each_mask_keeps_the_tokens_its_definition_keeps(knobs, expected):
    assert kept(**knobs) == expected


def test_the_kept_logits_are_renormalised_and_keep_their_gradient():
    logits = LOGITS.clone().requires_grad_(True)
    out = restrict(logits, torch.tensor([[2.0, 1.0, 0.0]]))
    logprobs = out.log_softmax(-1)
    assert logprobs[0, 0].item() == pytest.approx(2.0 - math.log(math.exp(2.0) + math.exp(1.0)))
    logprobs[0, 0].backward()
    assert logits.grad[0, 2:].tolist() == [0.0, 0.0] and logits.grad[0, :2].abs().sum() > 0


def test_rows_keep_their_own_support():
    rows = restrict(LOGITS.repeat(2, 1).clone(), torch.tensor([[2.0, 1.0, 0.0], [-1.0, 1.0, 0.0]]))
    assert torch.isfinite(rows).sum(-1).tolist() == [2, 4]


def test_a_calls_record_gives_its_support_with_top_k_off_as_minus_one():
    assert support({"top_k": 0, "top_p": 0.9, "min_p": 0.05}) == (-1, 0.9, 0.05)
    assert support({"top_k": 20}) == (20, 1.0, 0.0) and support({}) == (-1, 1.0, 0.0)
