"""Metrics and denominators of the policy step checked against float64 hand computations (issue #28): GSPO with
the IS correction reports train/approx_kl against the trainer's old log-probs (its ratio is the engine's), and a
sequence-mean loss counts only rows that have a token to learn from."""

from __future__ import annotations

import torch

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.observability.trace import add_loss_weights
from rlhfkit.rl.policy_step import policy_loss
from rlhfkit.rl.ppo_trainer import learning_rows


def _cfg(**flags):
    base = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "n_samples_per_prompt": 4,
            "rollout_batch_size": 8, "train_batch_size": 8}
    return parse_config("ppo", None, flags_to_argv({**base, **flags}))


def test_gspo_with_is_correction_reports_approx_kl_against_the_old_log_probs():
    g = torch.Generator().manual_seed(1)
    log_probs = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    old = log_probs + 0.05 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    rollout = log_probs + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)  # the engine's, further off
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mb = {"action_mask": mask, "advantages": torch.randn(3, 6, generator=g, dtype=torch.float64),
          "rollout_log_probs": rollout}
    cfg = _cfg(policy_loss_type="gspo", enable_vllm_is_correction=True)
    out = policy_loss(cfg, mb, log_probs, torch.zeros_like(log_probs), old, {}, num_tokens=float(mask.sum()),
                      num_seqs=3.0, kl_coef=0.0)
    expected = float(((old - log_probs) * mask).sum() / mask.sum())  # mean(log pi_old - log pi)
    wrong = float(((rollout - log_probs) * mask).sum() / mask.sum())  # what was reported before
    assert abs(expected - wrong) > 1e-2  # the two differ on these inputs, so the check bites
    assert abs(float(out.metrics["approx_kl"]) - expected) < 1e-12


def test_the_sequence_mean_leaves_out_rows_without_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert learning_rows(mask) == 2.0  # OpenRLHF and aggregate_loss's seq_mean count rows with a token
    assert learning_rows(torch.zeros(2, 3, dtype=torch.bool)) == 1.0  # never a division by zero

    class Exp:
        batch_size = 4
        info: dict = {}

    exp = Exp()
    add_loss_weights(exp, torch.arange(4), mask, float(mask.sum()), learning_rows(mask), seq_mean=True)
    weights = next(iter(exp.info.values()))
    assert weights.tolist() == [0.5, 0.0, 0.5, 0.0]  # the trace's loss weights sum to 1 over the rows that count
