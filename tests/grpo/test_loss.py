"""The per-token objective: PG direction, clip-higher, truncated IS per token, k3 KL."""

import math

import pytest
import torch

from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.loss import policy_loss


def _loss(logp, old, behavior, adv, ref=None, **cfg):
    weights = torch.ones_like(logp) / logp.numel()
    return policy_loss(logp, old, behavior, ref, torch.tensor(adv), weights, GRPOConfig(**cfg))


def test_on_policy_gradient_raises_logprob_of_positive_advantage_tokens():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    loss, _ = _loss(logp, logp.detach(), logp.detach(), [1.0, -1.0])
    loss.backward()
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()  # descent raises row 0, lowers row 1
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-7)  # ratio 1: -A, averaged over ±A


@pytest.mark.parametrize("log_ratio,adv,clipped", [
    (0.5, 1.0, True),     # ratio 1.65 > 1 + 0.28 with A > 0: clipped, no gradient
    (0.2, 1.0, False),    # ratio 1.22 < 1.28: inside the clip-higher range
    (-0.5, -1.0, True),   # ratio 0.61 < 0.8 with A < 0: clipped
    (-0.5, 1.0, False),   # ratio < 0.8 with A > 0: the min keeps the unclipped term
])
def test_clip_higher(log_ratio, adv, clipped):
    old = torch.tensor([[-1.0]])
    logp = (old + log_ratio).requires_grad_(True)
    loss, stats = _loss(logp, old, old, [adv], epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    assert bool(stats["clipped"]) == clipped
    assert (float(logp.grad.abs()) == 0.0) == clipped


def test_each_token_is_weighted_by_its_own_behaviour_logprob_and_capped():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behavior = torch.tensor([[-1.0, -1.5, -5.0]])  # same policy, one version older, far older
    logp = old.clone().requires_grad_(True)
    _, stats = _loss(logp, old, behavior, [1.0], vllm_importance_sampling_clip_max=2.0)
    assert stats["log_is"].tolist() == pytest.approx([0.0, 0.5, 4.0])
    assert float(stats["is_capped"]) == 1.0
    loss, _ = _loss(logp, old, behavior, [1.0], vllm_importance_sampling_clip_max=2.0)
    loss.backward()
    # d loss / d logp_t = -A * w_t / 3 with w = (1, e^0.5, cap 2)
    assert (-logp.grad[0] * 3).tolist() == pytest.approx([1.0, 1.6487, 2.0], rel=1e-4)


def test_k3_kl_is_zero_at_the_reference_and_positive_away_from_it():
    ref = torch.tensor([[-1.0, -2.0]])
    _, at_ref = _loss(ref.clone(), ref, ref, [0.0], ref=ref, beta=0.1)
    _, away = _loss(ref + 0.3, ref + 0.3, ref + 0.3, [0.0], ref=ref, beta=0.1)
    assert float(at_ref["kl_sum"]) == pytest.approx(0.0, abs=1e-7)
    assert float(away["kl_sum"]) > 0


@pytest.mark.parametrize("delta", [0.3, -0.7, 1.5])
def test_the_kl_term_is_k3_with_its_gradient_scaled_by_beta(delta):
    # k3(x) = e^x - x - 1 with x = log π_ref − log π (Schulman's estimator); k1 would be -x, k2 x²/2
    ref = torch.tensor([[-1.0, -2.0]])
    logp = (ref - delta).requires_grad_(True)  # so x = delta
    loss, stats = _loss(logp, logp.detach(), logp.detach(), [0.0], ref=ref, beta=0.25)  # A = 0: only the KL
    loss.backward()
    k3 = math.exp(delta) - delta - 1
    assert float(stats["kl_sum"]) == pytest.approx(2 * k3, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(0.25 * k3, rel=1e-5)  # weights 1/2 each: the mean
    # d/dlogp of β·k3 = β·(1 − e^x), times the token weight 1/2
    assert logp.grad[0].tolist() == pytest.approx([0.25 * (1 - math.exp(delta)) / 2] * 2, rel=1e-5)


def _by_hand_batch():
    """Two samples, three positions; every number of the loss worked out below."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.2]])
    ratio = torch.tensor([[1.0, 1.5, 0.5], [2.0, 1.0, 1.0]])
    pi_old_over_mu = torch.tensor([[1.0, 3.0, 1.0], [0.5, 1.0, 1.0]])
    weights = torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.0, 0.5]])  # 0 = not trained (prompt, padding)
    return old + ratio.log(), old, old - pi_old_over_mu.log(), torch.tensor([1.0, -1.0]), weights


def test_policy_loss_and_its_statistics_match_the_numbers_by_hand():
    logp, old, behavior, adv, weights = _by_hand_batch()
    config = GRPOConfig(epsilon=0.2, epsilon_high=0.28, vllm_importance_sampling_clip_max=2.0)
    loss, stats = policy_loss(logp, old, behavior, None, adv, weights, config)
    # pg = -min(r·A, clip(r, 0.8, 1.28)·A):   row 0 (A=+1): -1, -1.28, -0.5   row 1 (A=-1): 2, 1, 1
    # TIS weight min(π_old/μ, 2):           row 0: 1, 2, 1                     row 1: 0.5, 1, 1
    # Σ pg·w_IS·c = (-0.5 - 0.64 + 0) + (1.0 + 0 + 0.5) = 0.36
    assert loss.item() == pytest.approx(0.36) and stats["pg_loss"].item() == pytest.approx(0.36)
    assert stats["loss"].item() == pytest.approx(0.36) and not stats["loss"].requires_grad
    assert stats["tokens"].item() == 4  # positions with weight > 0
    assert stats["clipped"].item() == 1  # r = 1.5 > 1.28 with A > 0; r = 0.5 < 0.8 has A > 0, r = 2 has A < 0
    assert stats["is_capped"].item() == 1  # π_old/μ = 3 > 2
    assert stats["kl_sum"].item() == 0 and stats["kl_weighted"].item() == 0
    assert torch.allclose(stats["log_is"], torch.tensor([0.0, math.log(3.0), math.log(0.5), 0.0]))


def test_without_the_correction_tokens_are_not_reweighted_and_a_zero_beta_ignores_the_reference():
    logp, old, behavior, adv, weights = _by_hand_batch()
    ref = logp + 0.3
    loss, stats = policy_loss(logp, old, behavior, ref, adv, weights, GRPOConfig(vllm_importance_sampling_correction=False, beta=0.0))
    # Σ pg·c without TIS weights: (-0.5 - 0.32 + 0) + (2.0 + 0 + 0.5) = 1.68
    assert loss.item() == pytest.approx(1.68) and stats["is_capped"].item() == 0
    assert stats["kl_sum"].item() == 0 and stats["kl_weighted"].item() == 0


def test_the_kl_statistics_sum_k3_over_trained_tokens():
    logp, old, behavior, adv, weights = _by_hand_batch()
    delta = torch.tensor([[0.1, -0.2, 5.0], [0.3, 7.0, -0.4]])  # large values at untrained positions
    loss, stats = policy_loss(logp, old, behavior, logp + delta, adv, weights, GRPOConfig(beta=0.5))
    k3 = delta.exp() - delta - 1
    assert stats["kl_sum"].item() == pytest.approx(k3[weights > 0].sum().item())
    assert stats["kl_weighted"].item() == pytest.approx((k3 * weights).sum().item())
    assert loss.item() == pytest.approx(stats["pg_loss"].item() + 0.5 * stats["kl_weighted"].item())


@pytest.mark.parametrize("adv", [0.0, -1.0])
def test_a_token_is_counted_clipped_only_where_the_clip_bites(adv):
    logp, old = torch.tensor([[0.0, math.log(2.0)]]), torch.zeros(1, 2)  # ratios 1 and 2
    _, stats = policy_loss(logp, old, old, None, torch.tensor([adv]), torch.ones(1, 2), GRPOConfig())
    assert stats["clipped"].item() == 0  # ratio 1 never; ratio 2 only with a positive advantage


def test_token_logprobs_are_the_tempered_log_softmax_of_the_next_token():
    from types import SimpleNamespace

    from polar_lab.grpo.loss import token_logprobs

    torch.manual_seed(0)
    table = torch.randn(11, 11)

    def model(input_ids, attention_mask):  # logits depend on the token and on the mask, as a real model's do
        return SimpleNamespace(logits=table[input_ids] * (1.0 + attention_mask[..., None]))

    ids = torch.tensor([[1, 5, 2, 7], [3, 3, 9, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    temps = torch.tensor([1.0, 0.5])
    got = token_logprobs(model, ids, mask, temps)
    logits = (table[ids] * (1.0 + mask[..., None]))[:, :-1] / temps[:, None, None]
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (2, 3) and torch.allclose(got, want, atol=1e-6)


def test_a_low_ratio_counts_as_clipped_only_with_a_negative_advantage():
    logp, old = torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1)  # ratio 0.5 < 1 - epsilon
    for adv, clipped in ((0.5, 0), (0.0, 0), (-0.5, 1)):
        _, stats = policy_loss(logp, old, old, None, torch.tensor([adv]), torch.ones(1, 1), GRPOConfig())
        assert stats["clipped"].item() == clipped


def test_a_masked_position_whose_log_ratios_overflow_leaves_loss_and_gradient_finite():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2000.0]])  # position 1 is not trained: its log-ratio 1998 overflows exp
    behavior = torch.tensor([[-1.0, -5000.0]])
    ref = torch.tensor([[-1.0, 3000.0]])
    weights = torch.tensor([[1.0, 0.0]])
    loss, stats = policy_loss(logp, old, behavior, ref, torch.tensor([1.0]), weights, GRPOConfig(beta=0.1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert torch.isfinite(stats["kl_weighted"]) and stats["log_is"].tolist() == [0.0]


def test_only_models_whose_logits_are_their_heads_take_the_chunked_path():
    """`_plain_head`: the model type (or its text config's, for a multimodal wrapper) is on the allow-list and the
    model has a decoder and an output head; anything else — a softcapped family, a missing piece — is not."""
    from types import SimpleNamespace

    from polar_lab.grpo.loss import _plain_head

    class Model:
        def __init__(self, config, decoder=True, head=True):
            self.config, self._decoder, self._head = config, decoder, head

        def get_decoder(self):
            if self._decoder is None:
                raise NotImplementedError
            return object() if self._decoder else None

        def get_output_embeddings(self):
            return object() if self._head else None

    class Wrapper(SimpleNamespace):  # a multimodal config: the text model's type is in its text config
        def get_text_config(self):
            return self.text

    assert _plain_head(Model(SimpleNamespace(model_type="qwen3")))
    assert not _plain_head(Model(SimpleNamespace(model_type="gemma2")))  # softcapped logits
    assert _plain_head(Model(Wrapper(model_type="qwen3_5_vl", text=SimpleNamespace(model_type="qwen3_5_text"))))
    assert not _plain_head(Model(Wrapper(model_type="gemma3", text=SimpleNamespace(model_type="gemma3_text"))))
    assert not _plain_head(Model(SimpleNamespace(model_type="llama"), decoder=False))
    assert not _plain_head(Model(SimpleNamespace(model_type="llama"), decoder=None))  # it raises: not plain
    assert not _plain_head(Model(SimpleNamespace(model_type="llama"), head=False))
    assert not _plain_head(SimpleNamespace())  # no config at all


# ---- the correction menu, on _by_hand_batch: ρ = π_old/μ is row 0 [1, 3, ·], row 1 [0.5, ·, 1] over trained tokens;
# pg = row 0 [-1, -1.28, ·], row 1 [2, ·, 1]; c = row 0 [0.5, 0.25, ·], row 1 [1, ·, 0.5]
@pytest.mark.parametrize("mode,bounds,w,truncated,masked", [
    # IcePop: each token's ρ kept inside [0.6, 2], else 0
    ("token_mask", (0.6, 2.0), [[1.0, 0.0], [0.0, 1.0]], 0, 2),
    # the product of a row's ρ: row 0 1·3 = 3 → 2, row 1 0.5·1 = 0.5
    ("sequence_truncate", (None, 2.0), [[2.0, 2.0], [0.5, 0.5]], 2, 0),
    # MIS: row 0's product 3 > 2 masks the row
    ("sequence_mask", (None, 2.0), [[0.0, 0.0], [0.5, 0.5]], 0, 2),
    # the geometric mean: row 0 √3 and row 1 √0.5 both inside, kept at their value
    ("geometric_mask", (None, 2.0), [[math.sqrt(3), math.sqrt(3)], [math.sqrt(0.5), math.sqrt(0.5)]], 0, 0),
    # the geometric mean under a lower bound 0.8: row 1's √0.5 = 0.71 masks it
    ("geometric_mask", (0.8, 2.0), [[math.sqrt(3), math.sqrt(3)], [0.0, 0.0]], 0, 2),
])
def test_each_correction_mode_weights_the_tokens_as_its_formula_says(mode, bounds, w, truncated, masked):
    logp, old, behavior, adv, weights = _by_hand_batch()
    config = GRPOConfig(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=bounds[0],
                        vllm_importance_sampling_clip_max=bounds[1])
    loss, stats = policy_loss(logp, old, behavior, None, adv, weights, config)
    pg, c = [[-1.0, -1.28], [2.0, 1.0]], [[0.5, 0.25], [1.0, 0.5]]
    expected = sum(pg[i][j] * w[i][j] * c[i][j] for i in range(2) for j in range(2))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert (stats["is_capped"].item(), stats["is_masked"].item()) == (truncated, masked)


def test_the_mismatch_kl_is_k3_of_the_engine_vs_trainer_ratio_over_trained_tokens():
    logp, old, behavior, adv, weights = _by_hand_batch()
    _, stats = policy_loss(logp, old, behavior, None, adv, weights, GRPOConfig())
    k3 = [(rho - 1 - math.log(rho)) for rho in (1.0, 3.0, 0.5, 1.0)]  # KL(μ ‖ π_old) sampled from μ
    assert stats["mismatch_kl_sum"].item() == pytest.approx(sum(k3), rel=1e-5)


def test_gspo_clips_one_ratio_per_sequence_and_gives_its_tokens_one_gradient():
    logp, old, behavior, adv, weights = _by_hand_batch()
    logp = logp.clone().requires_grad_(True)
    config = GRPOConfig(importance_sampling_level="sequence", vllm_importance_sampling_correction=False)
    loss, stats = policy_loss(logp, old, behavior, None, adv, weights, config)
    loss.backward()
    # s = exp(mean log r over trained tokens): row 0 √1.5 = 1.2247 (inside 1.28), row 1 √2 = 1.4142 (A < 0: the
    # unclipped term wins the min); pg = -s·A on every trained token
    s0, s1 = math.sqrt(1.5), math.sqrt(2.0)
    assert loss.item() == pytest.approx(-s0 * (0.5 + 0.25) + s1 * (1.0 + 0.5), rel=1e-5)
    # d/d log π_t of -s·A·Σc = -A·Σc·s / |T| on each of the sample's |T| = 2 trained tokens, 0 elsewhere
    assert torch.allclose(logp.grad, torch.tensor([[-0.75 * s0 / 2, -0.75 * s0 / 2, 0.0],
                                                   [1.5 * s1 / 2, 0.0, 1.5 * s1 / 2]]), rtol=1e-5)
    assert stats["clipped"].item() == 0
    token_level = GRPOConfig(vllm_importance_sampling_correction=False)  # the control: per-token ratios differ
    logp.grad = None
    policy_loss(logp, old, behavior, None, adv, weights, token_level)[0].backward()
    assert logp.grad[0, 0].item() != pytest.approx(logp.grad[0, 1].item())


def test_cispo_weights_log_pi_by_the_capped_ratio_without_a_gradient_through_it():
    logp, old, behavior, adv, weights = _by_hand_batch()
    logp = logp.clone().requires_grad_(True)
    config = GRPOConfig(loss_type="cispo", epsilon_high=1.3, vllm_importance_sampling_correction=False)
    loss, stats = policy_loss(logp, old, behavior, None, adv, weights, config)
    loss.backward()
    # ℓ_t = -sg(min(r_t, 1.3))·A·log π_t·c_t; r = row 0 [1, 1.5, ·], row 1 [2, ·, 1]
    capped = [[1.0, 1.3, 0.0], [1.3, 0.0, 1.0]]
    a, c = [1.0, -1.0], weights.tolist()
    lp = logp.detach().tolist()
    expected = sum(-capped[i][j] * a[i] * lp[i][j] * c[i][j] for i in range(2) for j in range(3))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # the gradient is -min(r, 1.3)·A·c: a token past the cap still learns (PPO's clip would give it 0)
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.325, 0.0], [1.3, 0.0, 0.5]]), rtol=1e-5)
    assert stats["clipped"].item() == 1  # r = 1.5 > 1.3 with A > 0 (row 1's r = 2 has A < 0)



def test_a_teacher_shifts_each_tokens_advantage_by_its_reverse_kl():
    """On-policy distillation: A_t = A − λ·(log π_old − log π_teacher), no gradient through the teacher's term."""
    logp, old, behavior, adv, weights = _by_hand_batch()
    logp = logp.clone().requires_grad_(True)
    teacher = old + torch.tensor([[-0.5, 0.2, 9.0], [0.0, 9.0, 1.0]])  # 9.0 at untrained positions: ignored
    config = GRPOConfig(distill_coef=0.5, vllm_importance_sampling_correction=False)
    loss, stats = policy_loss(logp, old, behavior, None, adv, weights, config, teacher)
    loss.backward()
    # reverse KL per trained token: old − teacher = row 0 [0.5, -0.2], row 1 [0, -1];  A_t = A − 0.5·that:
    # row 0 (A = 1): 0.75, 1.1;  row 1 (A = -1): -1, -0.5;  ratios r = row 0 [1, 1.5], row 1 [2, 1] (clip 0.8-1.28)
    # pg = -min(r·A_t, clip(r)·A_t): row 0: -0.75, -1.28·1.1;  row 1: 2, 0.5
    expected = -0.75 * 0.5 - 1.28 * 1.1 * 0.25 + 2.0 * 1.0 + 0.5 * 0.5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["distill_kl_sum"].item() == pytest.approx(0.5 - 0.2 + 0.0 - 1.0, rel=1e-5)
    # d/dlogp = -A_t·r·c where unclipped: row 0 t0: -0.75·1·0.5; t1 clipped (r > 1.28, A_t > 0): 0
    assert logp.grad[0, 0].item() == pytest.approx(-0.375, rel=1e-5) and logp.grad[0, 1].item() == 0.0


def _tiny_lm(head_bias: bool = False, head_dtype: torch.dtype = torch.float32):
    """A random one-layer Qwen3 LM, built in memory (a model type with a plain lm_head: TokenLogprobs' chunked path);
    optionally an lm_head with a bias, in another dtype (FSDP's bf16-gathered head on GPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         max_position_embeddings=64, tie_word_embeddings=False)).eval()
    if head_bias or head_dtype != torch.float32:
        model.lm_head = torch.nn.Linear(16, 23, bias=head_bias).to(head_dtype)
        if head_bias:
            torch.nn.init.normal_(model.lm_head.bias, std=3.0)
    return model


def _by_hand_logprobs(model, ids, mask, temps, top_k):
    """log π of each next token from the whole logits, tempered, with all but each row's top_k logits and the
    target's own at -inf (top_k ≤ 0: the whole vocabulary); the head's product in fp32 from the decoder's hidden
    states. Also how many targets fell outside their row's top_k."""
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    head = model.lm_head
    logits = hidden @ head.weight.float().T + (head.bias.float() if head.bias is not None else 0.0)
    logits = logits[:, :-1] / temps[:, None, None]
    targets, outside = ids[:, 1:, None], 0
    for row, k in enumerate(top_k):
        if k > 0:
            kth = logits[row].topk(k, -1).values[..., -1:]
            cut = logits[row] < kth
            outside += int(cut.gather(-1, targets[row]).sum())
            logits[row] = logits[row].masked_fill(cut.scatter(-1, targets[row], False), float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1), outside


def test_chunked_and_reference_logprobs_apply_each_rows_support_and_attention_mask():
    """Row 0 samples within its top 3, row 1 over the whole vocabulary; row 1's first position is masked out (left
    padding), which changes every later position's logits. Most of row 0's targets fall outside its top 3: a sampled
    token is inside the sampler's support by definition, so each is kept in (finite, renormalised over the top 3 and
    itself), and counted."""
    from polar_lab.grpo.loss import TokenLogprobs, token_logprobs

    model = _tiny_lm()
    ids = torch.tensor([[1, 5, 2, 7, 9, 4, 4, 11], [3, 3, 9, 0, 17, 2, 8, 6]])
    mask = torch.tensor([[1] * 8, [0] + [1] * 7])
    temps = torch.tensor([0.7, 1.3])
    support = torch.tensor([[3.0, 1.0, 0.0], [-1.0, 1.0, 0.0]])[:, None, :].expand(2, 7, 3)  # (B, T-1, 3)
    want, outside = _by_hand_logprobs(model, ids, mask, temps, top_k=[3, -1])
    assert want.isfinite().all() and outside >= 4
    whole, _ = _by_hand_logprobs(model, ids, mask, temps, top_k=[-1, -1])
    assert (want[0] > whole[0] + 1e-4).all()  # renormalised over fewer tokens than the vocabulary
    with torch.no_grad():
        assert torch.allclose(token_logprobs(model, ids, mask, temps, support), want, atol=1e-5)
        for chunk in (5, None):
            scorer = TokenLogprobs(model, chunk=chunk)
            assert torch.allclose(scorer(ids, mask, temps, support), want, atol=1e-5)
            assert scorer.outside_support == outside
        unmasked = TokenLogprobs(model, chunk=5)(ids, torch.ones_like(mask), temps)
    assert not torch.allclose(unmasked[1], whole[1], atol=1e-3)


def test_a_head_in_another_dtype_with_a_bias_is_applied_in_fp32_bias_included():
    from polar_lab.grpo.loss import TokenLogprobs

    model = _tiny_lm(head_bias=True, head_dtype=torch.bfloat16)
    ids, temps = torch.tensor([[1, 5, 2, 7, 9, 4]]), torch.tensor([1.0])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = TokenLogprobs(model, chunk=4)(ids, mask, temps)
        want = _by_hand_logprobs(model, ids, mask, temps, top_k=[-1])[0]
        without_bias = want - _by_hand_logprobs(_tiny_lm(head_dtype=torch.bfloat16), ids, mask, temps, top_k=[-1])[0]
    assert torch.allclose(got, want, atol=1e-5) and without_bias.abs().max() > 1e-2  # the bias matters here
    plain = _tiny_lm(head_dtype=torch.bfloat16)  # and a bf16 head without one
    with torch.no_grad():
        assert torch.allclose(TokenLogprobs(plain, chunk=4)(ids, mask, temps),
                              _by_hand_logprobs(plain, ids, mask, temps, top_k=[-1])[0], atol=1e-5)


@pytest.mark.parametrize("mode, low, high, ratios, weights, truncated, masked", [
    # no bound at all: the ratio as it is
    ("token_truncate", None, None, [0.25, 1.0, 4.0], [0.25, 1.0, 4.0], [0, 0, 0], [0, 0, 0]),
    # a lower bound only: clamped up there, nothing above
    ("token_truncate", 0.5, None, [0.25, 1.0, 4.0], [0.5, 1.0, 4.0], [1, 0, 0], [0, 0, 0]),
    # a ratio exactly at both bounds is inside them
    ("token_truncate", 1.0, 1.0, [1.0, 2.0, 0.5], [1.0, 1.0, 1.0], [0, 1, 1], [0, 0, 0]),
    ("token_mask", 1.0, 1.0, [1.0, 2.0, 0.5], [1.0, 0.0, 0.0], [0, 0, 0], [0, 1, 1]),
    ("token_mask", None, 2.0, [0.25, 2.0, 4.0], [0.25, 2.0, 0.0], [0, 0, 0], [0, 0, 1]),
])
def test_the_correction_at_its_bounds_and_without_them(mode, low, high, ratios, weights, truncated, masked):
    from polar_lab.grpo.loss import correction

    config = GRPOConfig(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=low,
                        vllm_importance_sampling_clip_max=high)
    log_is = torch.tensor([ratios]).log()
    w, t, m = correction(log_is, torch.ones_like(log_is, dtype=torch.bool), config)
    assert w.tolist() == [weights] and t.int().tolist() == [truncated] and m.int().tolist() == [masked]


def test_a_sequences_geometric_mean_over_one_trained_token_is_that_tokens_ratio():
    from polar_lab.grpo.loss import correction

    config = GRPOConfig(vllm_importance_sampling_mode="geometric_mask", vllm_importance_sampling_clip_min=0.5,
                        vllm_importance_sampling_clip_max=2.0)
    log_is = torch.tensor([[math.log(3.0), 0.0, 0.0], [math.log(1.5), math.log(1.5), 0.0]])
    trained = torch.tensor([[True, False, False], [True, True, False]])
    w, _, masked = correction(log_is, trained, config)
    assert masked[:, 0].tolist() == [True, False]  # 3 is outside [0.5, 2]; 1.5 (both tokens' mean) inside
    assert w[1, 0].item() == pytest.approx(1.5)


def test_the_xray_holds_every_per_token_tensor_the_loss_used_and_only_when_asked():
    logp, old, behavior, adv, weights = _by_hand_batch()
    config = GRPOConfig()
    _, stats = policy_loss(logp, old, behavior, None, adv, weights, config)
    assert "xray" not in stats
    _, stats = policy_loss(logp, old, behavior, None, adv, weights, config, xray=True)
    xray = stats["xray"]
    assert sorted(xray) == ["advantage", "behavior", "clipped", "is_masked", "is_truncated", "is_weight", "logp",
                            "old", "weight"]
    assert all(v.shape == logp.shape for v in xray.values())
    assert torch.equal(xray["logp"], logp) and torch.equal(xray["old"], old)
    assert torch.equal(xray["behavior"], behavior) and torch.equal(xray["weight"], weights)
    assert torch.equal(xray["advantage"], adv[:, None].expand_as(logp))
    assert xray["clipped"][weights > 0].sum() == stats["clipped"]
    assert xray["is_truncated"][weights > 0].sum() == stats["is_capped"]
    assert torch.allclose(xray["is_weight"], torch.where(weights > 0, (old - behavior).exp().clamp(max=2.0), 1.0))


def test_cispo_scales_by_the_advantage_and_counts_a_ratio_at_its_cap_as_not_clipped():
    """Advantages other than ±1 (2 and -0.5) tell A·x from x/A; r = 2 exactly at the cap 2 is not clipped, nor is
    any ratio with A = 0."""
    logp = torch.tensor([[math.log(2.0), math.log(4.0)], [math.log(4.0), 0.0]], requires_grad=True)
    old = torch.zeros(2, 2)
    config = GRPOConfig(loss_type="cispo", epsilon_high=2.0, vllm_importance_sampling_correction=False)
    loss, stats = policy_loss(logp, old, old, None, torch.tensor([2.0, -0.5]), torch.ones(2, 2), config)
    lp = logp.detach()
    assert loss.item() == pytest.approx(-(2 * 2 * lp[0, 0] + 2 * 2 * lp[0, 1] - 0.5 * 2 * lp[1, 0] - 0.5 * lp[1, 1]))
    assert stats["clipped"].item() == 1  # r = 4 with A = 2 only
    _, stats = policy_loss(logp, old, old, None, torch.tensor([0.0, 0.0]), torch.ones(2, 2), config)
    assert stats["clipped"].item() == 0


def test_a_ratio_exactly_at_the_clip_range_is_not_counted_clipped():
    logp = torch.tensor([[math.log(0.5), math.log(2.0)]])  # 1 - ε and 1 + ε_high exactly (both exact floats)
    config = GRPOConfig(epsilon=0.5, epsilon_high=1.0, vllm_importance_sampling_correction=False)
    for adv in (-1.0, 1.0):
        _, stats = policy_loss(logp, torch.zeros(1, 2), torch.zeros(1, 2), None, torch.tensor([adv]),
                               torch.ones(1, 2), config)
        assert stats["clipped"].item() == 0
