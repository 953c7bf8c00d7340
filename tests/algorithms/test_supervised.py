"""Masked LM / ptx, distillation and PRM token losses against float64 loop references."""

import math

import pytest
import torch

from rlhfkit.algorithms.supervised import distillation_loss, masked_lm_loss, prm_token_loss, ptx_loss


def log_softmax(z):
    mx = max(z)
    s = math.log(math.fsum(math.exp(x - mx) for x in z)) + mx
    return [x - s for x in z]


def lm_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, :3] = -100  # prompt tokens
    labels[2, :] = -100  # an empty row
    return logits, labels


def ref_lm(logits, labels, mask, shift):
    total, n = [], 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - (1 if shift else 0)):
            lt = t + 1 if shift else t
            y = labels[b, lt].item()
            if y == -100 or not mask[b, lt]:
                continue
            total.append(-log_softmax(logits[b, t].tolist())[y])
            n += 1
    return math.fsum(total) / max(n, 1)


@pytest.mark.parametrize("shift", [True, False])
def test_masked_lm_loss_matches_reference(shift):
    logits, labels = lm_batch()
    mask = torch.ones_like(labels)
    mask[1, 2] = 0
    out = masked_lm_loss(logits, labels, mask, shift=shift)
    assert out.item() == pytest.approx(ref_lm(logits, labels, mask, shift), rel=1e-12)
    assert ptx_loss(logits, labels, mask, ptx_coef=0.05, shift=shift).item() == pytest.approx(0.05 * out.item())
    assert ptx_loss(logits, labels, mask, shift=shift).item() == pytest.approx(0.05 * out.item())  # --ptx_coef 0.05


def test_masked_lm_loss_agrees_with_torch_cross_entropy_and_handles_empty():
    logits, labels = lm_batch(1)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert masked_lm_loss(logits, labels).item() == pytest.approx(expected.item(), rel=1e-12)
    empty = masked_lm_loss(logits, torch.full_like(labels, -100))
    assert empty.item() == 0.0


def test_distillation_loss_matches_reference():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 4, 6, generator=g, dtype=torch.float64) * 2
    t = torch.randn(2, 4, 6, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    vals = []
    for b in range(2):
        for i in range(4):
            if mask[b, i]:
                ls, lt = log_softmax(s[b, i].tolist()), log_softmax(t[b, i].tolist())
                vals.append(math.fsum(math.exp(a) * (a - c) for a, c in zip(lt, ls)))
    assert distillation_loss(s, t, mask).item() == pytest.approx(math.fsum(vals) / len(vals), rel=1e-12)
    assert distillation_loss(t, t, mask).item() == pytest.approx(0.0, abs=1e-12)
    # a bf16 teacher (KD from a bf16 model) is upcast to the student's float64 before its softmax
    t16 = t.bfloat16()
    vals16 = []
    for b in range(2):
        for i in range(4):
            if mask[b, i]:
                ls, lt = log_softmax(s[b, i].tolist()), log_softmax(t16[b, i].double().tolist())
                vals16.append(math.fsum(math.exp(a) * (a - c) for a, c in zip(lt, ls)))
    assert distillation_loss(s, t16, mask).item() == pytest.approx(math.fsum(vals16) / len(vals16), rel=1e-12)


def test_distillation_gradient_equals_teacher_cross_entropy_gradient():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    t[0, 0, 1] = -float("inf")  # a token the teacher never emits
    mask = torch.ones(2, 3)
    loss = distillation_loss(s, t, mask)
    (grad,) = torch.autograd.grad(loss, s)
    ce = -(torch.softmax(t, -1) * torch.log_softmax(s, -1)).sum(-1).mean()
    (grad_ce,) = torch.autograd.grad(ce, s)
    vals = []  # KL(teacher || student) per token, 0 log 0 = 0 for the banned token
    for b in range(2):
        for i in range(3):
            ls, lt = log_softmax(s[b, i].tolist()), log_softmax(t[b, i].tolist())
            vals.append(math.fsum(math.exp(a) * (a - c) for a, c in zip(lt, ls) if a != -math.inf))
    assert loss.item() == pytest.approx(math.fsum(vals) / 6, rel=1e-12)
    torch.testing.assert_close(grad, grad_ce)
    with pytest.raises(ValueError, match="vocabulary"):
        distillation_loss(s, t[..., :4], mask)


PLACEHOLDER, GOOD, BAD = 9, 3, 4


def prm_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 10, generator=g, dtype=torch.float64) * 2
    ids = torch.tensor([[1, 2, PLACEHOLDER, 5, PLACEHOLDER, 0], [PLACEHOLDER, 1, 1, 1, 1, 0]])
    return logits, ids


def test_prm_hard_labels_restricted_to_reward_tokens():
    logits, ids = prm_batch()
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[0, 4], labels[1, 0] = GOOD, BAD, GOOD
    loss, acc = prm_token_loss(logits, ids, labels, placeholder_token_id=PLACEHOLDER, reward_token_ids=[GOOD, BAD])
    vals, hits = [], []
    for b, t, cls in [(0, 2, 0), (0, 4, 1), (1, 0, 0)]:
        z = [logits[b, t, GOOD].item(), logits[b, t, BAD].item()]
        vals.append(-log_softmax(z)[cls])
        hits.append((0 if z[0] >= z[1] else 1) == cls)
    assert loss.item() == pytest.approx(math.fsum(vals) / 3, rel=1e-12)
    assert acc.item() == pytest.approx(sum(hits) / 3)


def test_prm_hard_labels_over_the_whole_vocabulary():
    logits, ids = prm_batch()
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[0, 4], labels[1, 0] = 7, 1, 0
    loss, _ = prm_token_loss(logits, ids, labels, placeholder_token_id=PLACEHOLDER)
    vals = [-log_softmax(logits[b, t].tolist())[y] for b, t, y in [(0, 2, 7), (0, 4, 1), (1, 0, 0)]]
    assert loss.item() == pytest.approx(math.fsum(vals) / 3, rel=1e-12)


def test_prm_soft_labels():
    logits, ids = prm_batch()
    labels = torch.zeros(ids.shape, dtype=torch.float64)
    labels[0, 2], labels[0, 4], labels[1, 0] = 0.9, 0.2, 1.0
    loss, acc = prm_token_loss(logits, ids, labels, placeholder_token_id=PLACEHOLDER, reward_token_ids=[GOOD, BAD])
    vals, hits = [], []
    for b, t, p in [(0, 2, 0.9), (0, 4, 0.2), (1, 0, 1.0)]:
        z = [logits[b, t, GOOD].item(), logits[b, t, BAD].item()]
        lp = log_softmax(z)
        vals.append(-(p * lp[0] + (1 - p) * lp[1]))
        hits.append((z[0] >= z[1]) == (p >= 0.5))  # predicted "good" iff the target's more likely class is good
    assert loss.item() == pytest.approx(math.fsum(vals) / 3, rel=1e-12)
    assert acc.item() == pytest.approx(sum(hits) / 3, rel=1e-12)
    assert 0 < sum(hits) < 3  # the batch has both hits and misses, so the accuracy is not a trivial 0 or 1


@pytest.mark.parametrize("bad", [-0.01, 1.01, -1.0, 2.0])
def test_prm_soft_labels_outside_zero_one_are_refused(bad):
    logits, ids = prm_batch()
    labels = torch.zeros(ids.shape, dtype=torch.float64)
    labels[0, 2], labels[0, 4], labels[1, 0] = 0.5, bad, 0.5
    with pytest.raises(ValueError, match="probabilities in \\[0, 1\\]"):
        prm_token_loss(logits, ids, labels, placeholder_token_id=PLACEHOLDER, reward_token_ids=[GOOD, BAD])


def test_prm_soft_labels_accept_the_bounds_and_the_loss_is_minimal_at_the_target():
    """p = 0 and p = 1 are valid; the loss is a cross-entropy, so it is smallest when the predicted
    two-class distribution equals the target one (sign or target-order mistakes move the minimum)."""
    ids = torch.tensor([[PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]])
    labels = torch.tensor([[0.0, 1.0, 0.7]], dtype=torch.float64)

    def loss_at(margin):
        logits = torch.zeros(1, 3, 10, dtype=torch.float64)
        logits[0, :, GOOD] = margin  # softmax over (GOOD, BAD) = (sigmoid(margin), 1 - sigmoid(margin))
        return prm_token_loss(logits, ids, labels, placeholder_token_id=PLACEHOLDER, reward_token_ids=[GOOD, BAD])[0]

    # per row: -(p log s + (1 - p) log(1 - s)) with s = sigmoid(margin); all three rows share the margin
    def reference(m):
        s = 1 / (1 + math.exp(-m))
        return math.fsum(-(p * math.log(s) + (1 - p) * math.log(1 - s)) for p in (0.0, 1.0, 0.7)) / 3

    for m in (-2.0, 0.0, 0.5, 3.0):
        assert loss_at(m).item() == pytest.approx(reference(m), rel=1e-12)
    best = math.log(1.7 / 1.3)  # the mean target is p = 1.7 / 3, so the minimum is at sigmoid(m) = 1.7 / 3
    assert loss_at(best).item() < min(loss_at(best - 0.1).item(), loss_at(best + 0.1).item())


def test_prm_errors_and_no_placeholder():
    logits, ids = prm_batch()
    labels = torch.full_like(ids, GOOD)
    labels[0, 4] = 5
    with pytest.raises(ValueError, match="not among --reward_tokens"):
        prm_token_loss(logits, ids, labels, placeholder_token_id=PLACEHOLDER, reward_token_ids=[GOOD, BAD])
    with pytest.raises(ValueError, match="two --reward_tokens"):
        prm_token_loss(logits, ids, labels.double(), placeholder_token_id=PLACEHOLDER)
    with pytest.raises(ValueError, match="probabilities"):
        prm_token_loss(logits, ids, labels.double(), placeholder_token_id=PLACEHOLDER, reward_token_ids=[GOOD, BAD])
    logits.requires_grad_(True)
    loss, acc = prm_token_loss(logits, torch.zeros_like(ids), labels, placeholder_token_id=PLACEHOLDER)
    assert loss.item() == 0.0 and loss.requires_grad
