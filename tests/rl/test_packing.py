"""`ppo --packing_samples`: one packed row per micro-batch, each shared prompt computed once. The packed forward must
give the padded forward's log-probs, entropies and gradients (float32, up to summation order)."""

from __future__ import annotations

import pytest
import torch
from ppo_helpers import KL_LOSS, assert_same_step, run

from rlhfkit.algorithms.entropy import entropy_from_logits
from rlhfkit.models.loading import load_causal_lm, load_scalar_model, scalar_outputs
from rlhfkit.models.logprobs import SamplingTruncation, log_probs_from_logits
from rlhfkit.models.positions import position_ids
from rlhfkit.models.tiny import build_tiny_moe_causal_lm
from rlhfkit.rl.experience import build_experience, trim_padding
from rlhfkit.rl.packing import pack_rollout, pack_scored_rows, packed_response_log_probs, packed_scalar_outputs

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [11, 12], [13, 14, 15]]
RESPONSES = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [], [31, 32, 33, 34]]


def _micro_batch() -> dict[str, torch.Tensor]:
    exp = build_experience(PROMPTS, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], [0, 0, 0, 1, 1, 2], 0)
    return trim_padding(exp.tensors())


def _padded(model, mb, temperature, truncation=None):
    seq, mask, width = mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1]
    logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                   logits_to_keep=width + 1).logits[:, :-1].float() / temperature
    return log_probs_from_logits(logits, seq[:, -width:], truncation=truncation), entropy_from_logits(logits.detach())


def test_the_packed_row_holds_each_prompt_once_and_every_response():
    mb = _micro_batch()
    packed = pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1])
    assert packed.input_ids[0].tolist() == [5, 6, 7, 8, 9, 20, 21, 22, 23, 24, 25, 26, 27, 28,
                                            11, 12, 29, 30, 13, 14, 15, 31, 32, 33, 34]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 5, 6, 7, 8, 9,
                                               0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]
    assert packed.num_tokens == sum(map(len, RESPONSES)) + 5 + 2 + 3   # padded: 6 rows x (5 + 5)
    allowed = packed.attention_mask(torch.float32)[0, 0] == 0
    assert allowed[8].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 8]       # response [23]: its prompt, itself
    assert allowed[16].nonzero().flatten().tolist() == [14, 15, 16]             # 29 sees prompt [11, 12]
    assert allowed[18].nonzero().flatten().tolist() == [18]                     # a prompt sees no other sample
    keep = packed.keep.tolist()
    assert keep[packed.pick[1, 0]] == 4 and keep[packed.pick[0, 0]] == 4        # the shared predictor of token 0
    assert keep[packed.pick[2, 3]] == 11                                        # 27 is predicted by 26
    assert packed.valid.sum().item() == sum(map(len, RESPONSES))


@pytest.mark.parametrize(("attn", "temperature", "truncation"), [
    ("sdpa", 1.0, None), ("sdpa", 0.7, None), ("eager", 1.0, None), ("eager", 0.7, None),
    # --top_k / --top_p: the shared prompt position's kept set serves responses with different tokens
    ("sdpa", 0.7, SamplingTruncation(top_k=20, top_p=0.9)), ("sdpa", 1.0, SamplingTruncation(top_p=0.5)),
])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_forward(tiny_model_dir, attn, temperature,
                                                                         truncation):
    """What the workers compute per micro-batch with packing_samples on, against the padded forward."""
    mb = _micro_batch()
    valid = mb["action_mask"]
    weights = torch.linspace(-1.0, 2.0, valid.numel()).view_as(valid) * valid
    results = []
    for packed in (False, True):
        model = load_causal_lm(tiny_model_dir, attn_implementation=attn)
        model.train()
        if packed:
            rollout = pack_rollout(mb["sequences"], mb["attention_mask"], valid.shape[1])
            log_probs, entropy = packed_response_log_probs(model, rollout, temperature, mask_dtype=torch.float32,
                                                           with_entropy=True, truncation=truncation)
        else:
            log_probs, entropy = _padded(model, mb, temperature, truncation)
        (log_probs * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((log_probs.detach() * valid, entropy * valid, grads))
    (lp_pad, ent_pad, g_pad), (lp_pack, ent_pack, g_pack) = results
    assert lp_pad.abs().sum() > 1.0                                  # a real comparison, not zeros against zeros
    torch.testing.assert_close(lp_pack, lp_pad, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_pack, ent_pad, rtol=0, atol=2e-5)
    assert g_pack.keys() == g_pad.keys() and len(g_pad) > 10
    for name, expected in g_pad.items():  # a shared prompt token sums its responses' gradients in another order
        scale = float(expected.abs().max())
        torch.testing.assert_close(g_pack[name], expected, rtol=1e-4, atol=1e-4 * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_packing_a_mixture_of_experts_model_matches_too(tmp_path):
    model = load_causal_lm(build_tiny_moe_causal_lm(str(tmp_path / "moe")))
    mb = _micro_batch()
    rollout = pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1])
    with torch.no_grad():
        packed, _ = packed_response_log_probs(model, rollout, 1.0, mask_dtype=torch.float32)
        padded, _ = _padded(model, mb, 1.0)
    torch.testing.assert_close(packed * mb["action_mask"], padded * mb["action_mask"], rtol=0, atol=2e-5)


def test_a_response_with_a_hole_in_its_attention_is_refused():
    mb = _micro_batch()
    mask = mb["attention_mask"].clone()
    mask[2, -2] = 0                                                   # row 2's response: real, padding, real
    with pytest.raises(ValueError, match="row 2"):
        pack_rollout(mb["sequences"], mask, mb["action_mask"].shape[1])


@pytest.mark.slow
def test_packed_ppo_steps_equal_the_padded_ones(grpo_kl_loss_run, tiny_model_dir, echo_prompt_file,
                                               rollout_vllm_engine, tmp_path):
    """Two whole steps through the Ray workers with --packing_samples: the actor's training pass (old log-probs
    from it) and the reference's log-probs for a k3 KL loss. Every metric and the saved actor weights equal the
    padded run of the same flags (the session's `grpo_kl_loss_run`, tests/rl/conftest.py). The critic's values and
    value step and the reward model's scores, packed against padded in the same real workers: test_ring_ppo.py
    (assert_packed_equals_padded); the layout itself: the tests above."""
    padded_out, padded = grpo_kl_loss_run
    packed = run(tiny_model_dir, echo_prompt_file, tmp_path / "packed", rollout_vllm_engine, packing_samples=True,
                 **KL_LOSS)
    assert all("train/kl_loss" in r for r in packed) and packed[1]["rollout/kl"] > 0
    assert_same_step(padded, packed, padded_out, tmp_path / "packed", tiny_model_dir)


def test_packing_with_an_attention_kernel_that_ignores_4d_masks_is_refused(monkeypatch):
    import torch

    from rlhfkit.config.parse import flags_to_argv, parse_config
    from rlhfkit.errors import ConfigError
    from rlhfkit.rl.validate import validate_rl

    def cfg(**flags):
        base = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "n_samples_per_prompt": 4,
                "rollout_batch_size": 8, "train_batch_size": 8, "packing_samples": True}
        return parse_config("ppo", None, flags_to_argv({**base, **flags}))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where flash_attention_2 runs as such
    with pytest.raises(ConfigError, match="--packing_samples with --attn_implementation flash_attention_2"):
        validate_rl(cfg(attn_implementation="flash_attention_2"))
    validate_rl(cfg(attn_implementation="eager"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # without CUDA it runs as sdpa (#13)
    validate_rl(cfg(attn_implementation="flash_attention_2"))


def test_the_mfu_token_count_of_a_packed_pass_counts_each_prompt_once():
    from rlhfkit.rl.ppo_trainer import packed_tokens

    exp = build_experience(PROMPTS, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], [0, 0, 0, 1, 1, 2], 0)
    assert packed_tokens(exp) == 5 + 2 + 3 + sum(map(len, RESPONSES))
    mb = _micro_batch()
    assert packed_tokens(exp) == pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1]
                                              ).num_tokens


def test_packed_values_and_rewards_equal_the_padded_critic_and_reward_model(tiny_reward_model_dir):
    """Critic: the value of the state before each response token (with its gradient); reward model: the score at
    each row's last token, from the left-padded prompt + response batch `reward_batch` builds."""
    from rlhfkit.rl.reward_group import reward_batch
    from rlhfkit.rollout.types import RolloutSample

    mb = _micro_batch()
    valid = mb["action_mask"]
    width = valid.shape[1]
    weights = torch.linspace(-1.0, 2.0, valid.numel()).view_as(valid) * valid
    results = []
    for packed in (False, True):
        model = load_scalar_model(tiny_reward_model_dir)
        if packed:
            rollout = pack_rollout(mb["sequences"], mb["attention_mask"], width)
            values = packed_scalar_outputs(model, rollout, mask_dtype=torch.float32)[1]
        else:
            values = scalar_outputs(model, mb["sequences"], mb["attention_mask"])[1][:, -width - 1:-1]
        (values * weights).sum().backward()
        results.append((values.detach() * valid, {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}))
    (v_pad, g_pad), (v_pack, g_pack) = results
    assert v_pad.abs().sum() > 0.1
    torch.testing.assert_close(v_pack, v_pad, rtol=0, atol=2e-5)
    for name, expected in g_pad.items():
        torch.testing.assert_close(g_pack[name], expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))

    samples = [RolloutSample(k, i, p, r + [2], [0.0] * (len(r) + 1), "stop")
               for i, (k, p, r) in enumerate(zip([0, 0, 0, 1, 1, 2], PROMPTS, RESPONSES))]
    batch = reward_batch(samples, eos_token_id=2, pad_token_id=0)
    model = load_scalar_model(tiny_reward_model_dir)
    with torch.no_grad():
        padded = scalar_outputs(model, batch["sequences"], batch["attention_mask"])[0]
        rows = pack_scored_rows(batch["sequences"], batch["attention_mask"], batch["prompt_lengths"])
        packed = packed_scalar_outputs(model, rows, mask_dtype=torch.float32)[0]
    assert rows.num_tokens == 5 + 2 + 3 + sum(len(r) + 1 for r in RESPONSES)
    assert padded.std() > 0
    torch.testing.assert_close(packed, padded, rtol=0, atol=2e-5)
