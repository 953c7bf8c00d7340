"""--entropy_loss_coef is a gradient, not a number in the log: with the bonus on, the entropy the forward strategies
return carries the gradient of H = -sum_v p_v log p_v (p = softmax(logits / T)) back to the weights, checked against
a float64 autograd reference of the plain formula on a copy of the model; with the bonus off it is detached (a
metric), as before. Padded and packed rows, with and without --top_k truncation of the log-probs."""

from __future__ import annotations

import copy

import pytest
import torch
from test_ptx_coef import BASE, policy_batch

from rlhfkit.models.logprobs import SamplingTruncation
from rlhfkit.rl.forward import PackedForward, PaddedForward

T = 0.7


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _batch() -> dict[str, torch.Tensor]:
    """Two rows of one prompt (left-padded prompt of 4, responses of 3 and 2 tokens, right padding)."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(5, 400, (2, 7), generator=g)
    seq[:, :4] = seq[0, :4]
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    action = torch.tensor([[True, True, True], [True, True, False]])
    seq[1, 6] = 0
    return {"sequences": seq, "attention_mask": attention, "action_mask": action,
            "prompt_index": torch.tensor([0, 0]), "prompt_lengths": torch.tensor([4, 4])}


def _reference_grads(model, mb, temperature: float = T) -> dict[str, torch.Tensor]:
    """d/dθ sum over response tokens of H(softmax(z / temperature)), float64, plain autograd (no chunking, no
    fusion), on a float64 copy of `model`."""
    ref = copy.deepcopy(model).double()
    seq, mask, action = mb["sequences"], mb["attention_mask"], mb["action_mask"]
    width = action.shape[1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    z = ref(input_ids=seq, attention_mask=mask, position_ids=position_ids).logits[:, -width - 1:-1] / temperature
    entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    (entropy * action).sum().backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("strategy", [PaddedForward, PackedForward])
@pytest.mark.parametrize("truncation", [None, SamplingTruncation(top_k=20, top_p=1.0)])
def test_the_entropy_bonus_reaches_the_weights(tiny_model, strategy, truncation):
    mb = _batch()
    forward = strategy(T, truncation, torch.float32)
    tiny_model.zero_grad()
    _, entropy = forward.action_log_probs(tiny_model, mb, with_entropy=True, entropy_grad=True)
    assert entropy is not None and entropy.requires_grad
    (entropy * mb["action_mask"]).sum().backward()
    want = {n: g.float() for n, g in _reference_grads(tiny_model, mb).items()}
    got = {n: p.grad for n, p in tiny_model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for name, g in got.items():  # fp32 vs float64: summation order and the fp32 softmax, ~1e-6 of the largest
        assert float((g - want[name]).abs().max()) < 1e-4 * scale, name


@pytest.mark.parametrize("strategy", [PaddedForward, PackedForward])
def test_without_the_bonus_the_entropy_is_a_detached_metric(tiny_model, strategy):
    mb = _batch()
    log_probs, entropy = strategy(T, None, torch.float32).action_log_probs(tiny_model, mb, with_entropy=True)
    assert log_probs.requires_grad and entropy is not None and not entropy.requires_grad


def test_a_real_actor_step_gains_minus_coef_times_the_entropy_gradient(actor, tiny_model_dir):
    """In a real actor worker (tests/rl/conftest.py's `actor`: ModelWorker, 1-rank gloo group, lr 0): the
    gradient of a policy step at --entropy_loss_coef 1 minus the same step's at 0 is -1 x d/dθ (token-mean entropy),
    float64 reference."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.cli.ppo import GROUPS
    from rlhfkit.config.parse import flags_to_argv, parse_config

    data = policy_batch()
    tokens = float(data["action_mask"].sum())
    grads = []
    for coef in (0.0, 1.0):
        worker, seen = actor(parse_config("ppo", GROUPS, flags_to_argv({**BASE, "entropy_loss_coef": coef})))
        worker.train_policy_step(data, tokens)
        grads += seen
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mb = {k: data[k] for k in ("sequences", "attention_mask", "action_mask")}
    reference = {n: -g.double() / tokens for n, g in _reference_grads(model, mb, temperature=1.0).items()}
    without, with_bonus = grads
    largest = max(float(g.abs().max()) for g in reference.values())
    assert largest > 1e-4  # the bonus moves the weights: not a comparison of zeros
    for name, want in reference.items():
        torch.testing.assert_close(with_bonus[name] - without[name], want, rtol=0, atol=1e-3 * largest,
                                   msg=lambda m, n=name: f"{n}: {m}")
