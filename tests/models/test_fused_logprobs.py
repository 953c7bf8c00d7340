"""The fused log-prob + entropy function (rlhfkit/models/fused_logprobs.py) against float64 autograd of the plain
formulas, `torch.autograd.gradcheck`, and the training forward's helpers against the plain path on the tiny model.

Tolerances (measured on this CPU, AMD EPYC Zen 5, then given ~10x headroom), with s = 1 + max |logits / T| of the
row: float32 log-probs differ from float64 by <= 1.7e-7 s, entropies by <= 1.1e-6 s (H = lse - sum p z cancels), the
gradient by <= 5.4e-7 s (|g_lp| + |g_H|). bf16 logits are exactly representable in float32, so the results have
the same float32 error, while the bf16 gradient is the float64 gradient rounded to bf16 (relative error <= 2^-8).
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.models.fused_logprobs import pair_log_probs_and_entropy, token_log_probs_and_entropy
from rlhfkit.models.loading import load_causal_lm
from rlhfkit.models.logprobs import shifted_log_probs_and_entropy
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.packing import kept_log_probs_and_entropy


def _reference(logits: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, temperature: float,
               grad_lp: torch.Tensor, grad_h: torch.Tensor | None):
    """float64 autograd of the textbook formulas: log_softmax, and H = -sum p log p (not the lse - sum p z form the
    code uses)."""
    x = logits.detach().double().requires_grad_()
    log_p = torch.log_softmax(x / temperature, dim=-1)
    lp = log_p[rows, labels]
    entropy = -(log_p.exp() * log_p).sum(-1)
    loss = (lp * grad_lp.double()).sum()
    if grad_h is not None:
        loss = loss + (entropy * grad_h.double()).sum()
    loss.backward()
    assert x.grad is not None
    return lp.detach(), entropy.detach(), x.grad


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, atol: float) -> bool:
    return bool(((got.double() - want).abs() <= atol + rel * want.abs()).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("num_rows", "vocab", "chunk_rows"), [(1, 5, None), (7, 11, 3), (40, 300, None),
                                                               (40, 300, 7)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_match_float64_autograd(dtype, temperature, num_rows, vocab, chunk_rows, with_entropy):
    gen = torch.Generator().manual_seed(num_rows * vocab)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 4).to(dtype).requires_grad_()
    # every row once, then some rows again (a packed prompt's last position predicts several responses' first token)
    rows = torch.cat([torch.arange(num_rows), torch.randint(0, num_rows, (5,), generator=gen)])
    labels = torch.randint(0, vocab, rows.shape, generator=gen)
    grad_lp = torch.randn(rows.shape, generator=gen)
    grad_h = torch.randn(num_rows, generator=gen) if with_entropy else None
    ref_lp, ref_h, ref_grad = _reference(logits, rows, labels, temperature, grad_lp, grad_h)

    lp, h = pair_log_probs_and_entropy(logits, rows, labels, temperature=temperature, with_entropy=with_entropy,
                                       chunk_rows=chunk_rows)
    # float32 rounding grows with the size of the tempered logits (log-sum-exp, and H = lse - S cancels)
    scale = 1 + (logits.detach().double() / temperature).abs().amax(-1)                        # [R]
    assert lp.dtype == torch.float32 and lp.shape == rows.shape
    assert bool(((lp.double() - ref_lp).abs() <= 2e-6 * scale[rows]).all())    # measured <= 1.7e-7 x scale
    loss = (lp * grad_lp).sum()
    if with_entropy:
        assert h is not None and h.dtype == torch.float32 and h.shape == (num_rows,)
        assert bool(((h.double() - ref_h).abs() <= 1e-5 * scale).all())       # measured <= 1.1e-6 x scale
        loss = loss + (h * grad_h).sum()
    else:
        assert h is None
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == dtype
    # per row: (sum of |g_lp| read there + |g_H|) x scale bounds the float32 error; bf16 adds its rounding (2^-8)
    upstream = torch.zeros(num_rows, dtype=torch.float64).index_add_(0, rows, grad_lp.double().abs())
    if grad_h is not None:
        upstream = upstream + grad_h.double().abs()
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
    error = (logits.grad.double() - ref_grad).abs()
    assert bool((error <= rounding * ref_grad.abs() + 5e-6 * (scale * upstream)[:, None]).all())  # measured 5.4e-7


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_in_float64(with_entropy):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 6, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    rows, labels = torch.tensor([0, 1, 1, 3, 4, 4]), torch.tensor([2, 0, 5, 3, 1, 1])

    def fn(x):
        lp, h = pair_log_probs_and_entropy(x, rows, labels, temperature=0.7, with_entropy=with_entropy,
                                           chunk_rows=2)
        return (lp, h) if h is not None else lp

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_only_the_entropy_gradient_when_the_log_probs_are_unused():
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    rows, labels = torch.arange(4), torch.tensor([1, 2, 3, 4])
    _, h = pair_log_probs_and_entropy(logits, rows, labels, with_entropy=True)
    assert h is not None
    h.sum().backward()
    _, _, ref_grad = _reference(logits, rows, labels, 1.0, torch.zeros(4), torch.ones(4))
    assert logits.grad is not None and torch.allclose(logits.grad, ref_grad, atol=1e-12)


def test_ignored_labels_give_zero_and_no_log_prob_gradient():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 13, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (2, 4), generator=gen)
    labels[0, 1] = labels[1, 3] = -100                     # padding
    lp, h = token_log_probs_and_entropy(logits, labels, temperature=1.3, with_entropy=True)
    assert lp.shape == h.shape == (2, 4) and lp[0, 1] == 0.0 and lp[1, 3] == 0.0
    kept = labels != -100
    rows = torch.arange(8)[kept.flatten()]
    ref_lp, ref_h, ref_grad = _reference(logits.reshape(8, 13), rows, labels.flatten()[kept.flatten()], 1.3,
                                         torch.ones(len(rows)), None)
    assert _close(lp[kept], ref_lp, 1e-5, 1e-6) and _close(h.flatten(), ref_h, 1e-5, 1e-6)
    lp.sum().backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[0, 1], torch.zeros(13)) and torch.equal(logits.grad[1, 3], torch.zeros(13))
    assert _close(logits.grad.reshape(8, 13), ref_grad, 1e-5, 1e-6)


def test_banned_tokens_at_minus_infinity_are_left_out():
    """A -inf logit has probability 0: the results and gradients equal those over the other columns alone."""
    gen = torch.Generator().manual_seed(3)
    finite = torch.randn(3, 8, generator=gen)
    logits = finite.clone()
    logits[:, 5:] = -torch.inf
    logits.requires_grad_()
    rows, labels = torch.arange(3), torch.tensor([0, 4, 2])
    lp, h = pair_log_probs_and_entropy(logits, rows, labels, with_entropy=True)
    assert h is not None
    (lp.sum() + h.sum()).backward()
    ref_lp, ref_h, ref_grad = _reference(finite[:, :5], rows, labels, 1.0, torch.ones(3), torch.ones(3))
    assert _close(lp, ref_lp, 1e-5, 1e-6) and _close(h, ref_h, 1e-5, 1e-6)
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert _close(logits.grad[:, :5], ref_grad, 1e-5, 1e-6) and torch.equal(logits.grad[:, 5:], torch.zeros(3, 3))
    # the chunks are worked on in place: the caller's float32 logits are left as they were
    assert torch.equal(logits.detach()[:, :5], finite[:, :5]) and bool((logits.detach()[:, 5:] == -torch.inf).all())


def test_bad_pairs_and_temperature_are_refused():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match="outside"):
        pair_log_probs_and_entropy(logits, torch.tensor([0, 3]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="outside"):
        pair_log_probs_and_entropy(logits, torch.tensor([0, 1]), torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="temperature"):
        pair_log_probs_and_entropy(logits, torch.tensor([0]), torch.tensor([1]), temperature=0.0)


def _saved_sizes(fn) -> list[int]:
    """The element counts of the tensors autograd saves while `fn` runs (each distinct storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(seen.values())


def test_the_backward_keeps_no_float32_copy_of_the_logits():
    """Plain autograd keeps [R, V] float32 tensors (upcast, tempered, softmax) for the backward; the fused function
    keeps only the input logits and [R]-sized statistics."""
    rows_, vocab = 16, 1000
    logits = torch.randn(rows_, vocab).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (rows_,))

    def plain():
        z = logits.float() / 0.7
        (z.gather(-1, labels[:, None]) - torch.logsumexp(z, -1, keepdim=True)).sum().backward()

    def fused():
        token_log_probs_and_entropy(logits, labels, temperature=0.7, with_entropy=True)[0].sum().backward()

    big = rows_ * vocab
    assert sum(size >= big for size in _saved_sizes(plain)) >= 1
    fused_sizes = _saved_sizes(fused)
    assert [size for size in fused_sizes if size >= big] == [big]      # the bf16 logits themselves
    assert sum(size for size in fused_sizes if size < big) <= 10 * rows_


def test_kept_positions_with_shared_rows_and_invalid_entries():
    """The packed layout: several (row, token) pairs read one kept position, invalid entries are 0."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 17, generator=gen).to(torch.bfloat16).requires_grad_()
    pick = torch.tensor([[0, 1, 2], [0, 3, 0]])
    labels = torch.tensor([[3, 5, 7], [9, 11, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    lp, h = kept_log_probs_and_entropy(logits, pick, labels, valid, 0.8, with_entropy=True)
    assert h is not None and not h.requires_grad and lp[1, 2] == 0.0 and h[1, 2] == 0.0
    weights = torch.randn(2, 3, generator=gen)
    (lp * weights).sum().backward()
    ref_lp, ref_h, ref_grad = _reference(logits, pick[valid], labels[valid], 0.8, weights[valid], None)
    assert _close(lp[valid], ref_lp, 1e-5, 1e-6) and _close(h[valid], ref_h[pick[valid]], 1e-5, 1e-6)
    assert logits.grad is not None and _close(logits.grad, ref_grad, 2.0 ** -8, 1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_a_policy_gradient_through_the_tiny_model_equals_the_plain_path(tiny_model_dir, temperature):
    """The padded training forward's helper against the code it replaced (upcast + temperature + logsumexp on the
    whole [B, W, V] logits), float32: the same log-probs, entropies and parameter gradients."""
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir)
    seq = torch.randint(3, 200, (3, 12))
    mask = torch.ones_like(seq)
    mask[1, :3] = 0                                         # a left-padded prompt
    width = 6
    advantages = torch.randn(3, width)

    def step(new: bool):
        model.zero_grad()
        logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=width + 1).logits
        if new:
            lp, h = shifted_log_probs_and_entropy(logits, seq, width, temperature, with_entropy=True)
        else:
            z = logits[:, :-1].float() / temperature
            lp = z.gather(-1, seq[:, -width:, None]).squeeze(-1) - torch.logsumexp(z, -1)
            h = torch.logsumexp(z.detach(), -1) - (torch.softmax(z.detach(), -1) * z.detach()).sum(-1)
        assert h is not None
        (-(lp * advantages).mean()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return lp.detach(), h, grads

    new_lp, new_h, new_grads = step(True)
    old_lp, old_h, old_grads = step(False)
    assert not new_h.requires_grad
    assert torch.allclose(new_lp, old_lp, rtol=1e-6, atol=1e-6) and torch.allclose(new_h, old_h, rtol=1e-5, atol=1e-6)
    assert new_grads.norm() > 0
    assert torch.allclose(new_grads, old_grads, rtol=1e-5, atol=1e-7)
    assert float(new_grads.norm()) == pytest.approx(float(old_grads.norm()), rel=1e-6)
