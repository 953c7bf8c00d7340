"""--ptx_coef weights the auxiliary LM loss of the actor's policy step: in a real actor worker (rlhfkit.rl.worker.
ModelWorker on a 1-rank gloo group in this process, `init_model` as the driver calls it), the gradient of a step with a
--pretrain_data batch minus the gradient of the same step without it equals ptx_coef x the gradient of the token-mean
LM loss of that batch, computed here independently in float64 on the same weights."""

from __future__ import annotations

import torch

from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config

BASE = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "advantage_estimator": "reinforce",
        "init_kl_coef": 0, "micro_train_batch_size": 8, "seed": 1}
COEF = 0.5
PTX_ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]  # unpadded: positions 0..6 either way
PTX_LOSS_MASK = [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]]        # the target tokens (labels, HF shift)


def policy_batch() -> dict[str, torch.Tensor]:
    from rlhfkit.rl.experience import build_experience

    g = torch.Generator().manual_seed(3)
    prompts, responses = [[5, 6, 7], [8, 9]], [[20, 21, 22], [23, 24]]
    exp = build_experience(prompts, responses, [[-1.0] * len(r) for r in responses], [0, 1], 0)
    exp.advantages = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask.float()
    return exp.tensors()


def reference_lm_gradient(model_dir: str, targets: int) -> dict[str, torch.Tensor]:
    """d/dθ of -Σ_t m_t log p_θ(y_{t+1} | y_≤t) / targets over PTX_ROWS, in float64 (transformers' own forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    ids = torch.tensor(PTX_ROWS)
    logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = torch.tensor(PTX_LOSS_MASK, dtype=torch.float64)[:, 1:]
    (-(logp * mask).sum() / targets).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_ptx_coef_weights_the_lm_loss_gradient_of_the_policy_step(actor, tiny_model_dir):
    cfg = parse_config("ppo", GROUPS, flags_to_argv({**BASE, "ptx_coef": COEF}))
    worker, grads = actor(cfg)
    data = policy_batch()
    tokens = float(data["action_mask"].sum())
    ptx = {"sequences": torch.tensor(PTX_ROWS), "attention_mask": torch.ones(2, 7, dtype=torch.long),
           "loss_mask": torch.tensor(PTX_LOSS_MASK)}
    targets = sum(sum(row[1:]) for row in PTX_LOSS_MASK)  # 10 target tokens after the shift
    worker.train_policy_step(data, tokens)
    out = worker.train_policy_step(data, tokens, ptx=ptx, ptx_tokens=float(targets))
    assert "ptx_loss" in out
    without, with_ptx = grads
    reference = reference_lm_gradient(tiny_model_dir, targets)
    assert set(reference) <= set(with_ptx)
    largest = max(float(g.abs().max()) for g in reference.values())
    assert largest > 1e-2  # the LM loss moves the weights: not a comparison of zeros
    for name, lm_grad in reference.items():
        torch.testing.assert_close(with_ptx[name] - without[name], COEF * lm_grad, rtol=0,
                                   atol=1e-5 * largest, msg=lambda m, n=name: f"{n}: {m}")
