"""On a fixed batch, each offline method's loss equals the algorithms module's reference function.

The reference side scores every sequence on its own (no padding, float64 log-softmax) and calls the function of
`rlhfkit.algorithms` directly, so these tests also check the batching: concatenation of chosen and rejected rows,
right padding, masks, the precomputed reference log-probs and the sum convention of the shared loop.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhfkit.algorithms.preference import dpo_loss, kto_loss, reward_model_loss
from rlhfkit.algorithms.supervised import distillation_loss, masked_lm_loss, prm_token_loss
from rlhfkit.config.parse import parse_config
from rlhfkit.data.collate import model_inputs
from rlhfkit.data.synthetic import echo_rows, preference_rows, process_rows, unpaired_rows
from rlhfkit.engine.distributed import init_distributed, shutdown_distributed
from rlhfkit.trainers.dpo import REF_KEYS, collate_pairs, dpo_batch_loss, dpo_method
from rlhfkit.trainers.kd import kd_method
from rlhfkit.trainers.kto import COMPLETION, MISMATCHED, attach_mismatched, collate_kto, kto_batch_loss, kto_method
from rlhfkit.trainers.pairs import PAIR_SIDES, preference_samples
from rlhfkit.trainers.prm import collate_prm, prm_batch_loss, prm_method, prm_samples
from rlhfkit.trainers.rm import collate_rm, rm_batch_loss, rm_method
from rlhfkit.trainers.sequence_logps import annotate_reference

PAIR_CFG = SimpleNamespace(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", input_template=None,
                           apply_chat_template=True, max_len=64)


@pytest.fixture
def dist_info():
    """The (one-process) distributed set-up the methods' reference and teacher loaders need."""
    owned = not dist.is_initialized()
    try:
        yield init_distributed()
    finally:
        if owned:
            shutdown_distributed()


def flags(options: dict) -> list[str]:
    """{"beta": 0.5, "ipo": True} -> ["--beta", "0.5", "--ipo"]: the command line that sets these options."""
    out: list[str] = []
    for name, value in options.items():
        out += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return out


def seq_logp(model, ids: list[int], mask: list[int]) -> tuple[torch.Tensor, int]:
    """Float64 sum of log p(target tokens) of one unpadded sequence, and the number of targets."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    m = torch.tensor(mask[1:], dtype=torch.float64)
    return (lp * m).sum(), int(m.sum())


def side_logps(model, samples, ids_key, mask_key):
    out = [seq_logp(model, s[ids_key], s[mask_key]) for s in samples]
    return torch.stack([v for v, _ in out]), torch.tensor([c for _, c in out], dtype=torch.float64)


@pytest.fixture
def pairs(tokenizer):
    rows = preference_rows(3, seed=5)
    rows[1]["chosen"] = "a much longer chosen answer so that the batch is padded"
    samples, stats = preference_samples(PAIR_CFG, tokenizer, rows)
    assert stats["kept"] == 3
    return samples


VARIANTS = {"dpo": dict(beta=0.1), "cdpo": dict(beta=0.5, label_smoothing=0.2), "ipo": dict(beta=0.1, ipo=True),
            "dpo+nll": dict(beta=0.2, nll_loss_coef=0.7)}


def test_dpo_loss_equals_reference_function(policy, other, other_model_dir, tiny_model_dir, pairs, tokenizer,
                                            dist_info):
    """dpo's --beta, --label_smoothing, --ipo and --nll_loss_coef, parsed from a command line, through dpo_method's
    loss (the reference live from --ref_pretrain) against the reference function with the same values."""
    batch = collate_pairs(pairs, tokenizer.pad_token_id)
    (pc, nc), (pr, nr) = (side_logps(policy, pairs, *side) for side in PAIR_SIDES)
    (rc, _), (rr, _) = (side_logps(other, pairs, *side) for side in PAIR_SIDES)
    for name, variant in VARIANTS.items():
        cfg = parse_config("dpo", None, ["--pretrain", tiny_model_dir, "--ref_pretrain", other_model_dir,
                                         "--ref_mode", "live", "--dataset", "d", *flags(variant)])
        loss, metrics = dpo_method(cfg, tokenizer, dist_info).loss(policy, batch)
        ipo = variant.get("ipo", False)
        args = (pc / nc, pr / nr, rc / nc, rr / nr) if ipo else (pc, pr, rc, rr)
        expected, chosen_r, rejected_r = dpo_loss(*args, beta=variant["beta"],
                                                  label_smoothing=variant.get("label_smoothing", 0.0), ipo=ipo,
                                                  reduction="sum")
        expected = expected + variant.get("nll_loss_coef", 0.0) * (-(pc / nc).sum())
        assert expected.dtype == torch.float64
        assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5, abs=1e-5), name
        assert float(metrics["reward_margin"]) == pytest.approx(float((chosen_r - rejected_r).sum()), abs=1e-4), name
        assert float(metrics["chosen_logps"]) == pytest.approx(float(pc.sum()), rel=1e-5), name
        if name == "dpo":
            h = (pc - pr) - (rc - rr)  # the DPO formula written out, float64
            assert float(loss.detach()) == pytest.approx(float(-F.logsigmoid(variant["beta"] * h).sum()), rel=1e-5)
            loss.backward()
            # the gradient is the float64 reference's, sequence by sequence through the same weights
            ref_logps = []
            for ids_key, mask_key in PAIR_SIDES:
                for sample in pairs:
                    ids = sample[ids_key]
                    logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].double()
                    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                    ref_logps.append((lp * torch.tensor(sample[mask_key][1:], dtype=torch.float64)).sum())
            ref_pc, ref_pr = torch.stack(ref_logps[:len(pairs)]), torch.stack(ref_logps[len(pairs):])
            ref_loss = -F.logsigmoid(variant["beta"] * ((ref_pc - ref_pr) - (rc - rr))).sum()
            params = [p for p in policy.parameters() if p.grad is not None]
            assert len(params) == len(list(policy.parameters()))
            assert max(float(p.grad.abs().max()) for p in params) > 1e-2  # a gradient far above the tolerance
            for p, g in zip(params, torch.autograd.grad(ref_loss, params)):
                torch.testing.assert_close(p.grad, g.to(p.grad.dtype), rtol=1e-3, atol=1e-5)


def test_precomputed_reference_equals_live_reference(policy, other, other_model_dir, tiny_model_dir, pairs,
                                                     tokenizer):
    """dpo's --ref_pretrain: the precomputed log-probs are those of that model (not of --pretrain, the policy)."""
    cfg = parse_config("dpo", None, ["--pretrain", tiny_model_dir, "--ref_pretrain", other_model_dir, "--dataset", "d",
                                     "--micro_train_batch_size", "2"])  # 2 chunks, the last one short
    owned = not dist.is_initialized()
    try:
        annotate_reference(cfg, pairs, tokenizer.pad_token_id,
                           [(*PAIR_SIDES[0], REF_KEYS[0]), (*PAIR_SIDES[1], REF_KEYS[1])])
    finally:
        if owned:
            shutdown_distributed()
    (rc, _), (rr, _) = (side_logps(other, pairs, *side) for side in PAIR_SIDES)
    assert [s[REF_KEYS[0]] for s in pairs] == pytest.approx(rc.tolist(), abs=1e-4)
    assert [s[REF_KEYS[1]] for s in pairs] == pytest.approx(rr.tolist(), abs=1e-4)
    batch = collate_pairs(pairs, tokenizer.pad_token_id)
    assert "ref_logps" in batch
    precomputed, _ = dpo_batch_loss(policy, batch, beta=0.1)
    live, _ = dpo_batch_loss(policy, batch, beta=0.1, ref_model=other)
    assert float(precomputed) == pytest.approx(float(live), rel=1e-5)


def test_dpo_without_reference_log_probs_is_an_error(policy, pairs, tokenizer):
    with pytest.raises(ValueError, match="ref_mode"):
        dpo_batch_loss(policy, collate_pairs(pairs, tokenizer.pad_token_id), beta=0.1)


@pytest.mark.parametrize("loss_type,margin", [("sigmoid", False), ("logexp", True)])
def test_reward_model_loss_equals_reference_function(tiny_reward_model_dir, pairs, tokenizer, loss_type, margin,
                                                     dist_info):
    """rm's --loss (parsed) through rm_method's loss: sigmoid and logexp both give the Bradley-Terry value."""
    from rlhfkit.models.loading import load_scalar_model, scalar_outputs

    model = load_scalar_model(tiny_reward_model_dir).eval()
    samples = [dict(s, margin=0.5 * i) for i, s in enumerate(pairs)] if margin else pairs
    cfg = parse_config("rm", None, ["--pretrain", tiny_reward_model_dir, "--dataset", "d", "--loss", loss_type])
    loss, metrics = rm_method(cfg, tokenizer, dist_info).loss(model, collate_rm(samples, tokenizer.pad_token_id))

    def reward(ids):
        ids_t = torch.tensor([ids])
        return scalar_outputs(model, ids_t, torch.ones_like(ids_t))[0][0].double()

    chosen = torch.stack([reward(s["chosen_ids"]) for s in samples])
    rejected = torch.stack([reward(s["rejected_ids"]) for s in samples])
    m = torch.tensor([s["margin"] for s in samples], dtype=torch.float64) if margin else None
    expected = reward_model_loss(chosen, rejected, loss=loss_type, margin=m, reduction="sum")
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    by_hand = -F.logsigmoid(chosen - rejected - (m if margin else 0.0)).sum()  # Bradley-Terry, float64
    assert float(loss) == pytest.approx(float(by_hand), rel=1e-5)
    assert float(metrics["accuracy"]) == float((chosen > rejected).sum())


def test_kto_loss_equals_reference_function(policy, other, other_model_dir, tiny_model_dir, tokenizer, dist_info):
    """kto's --beta, --desirable_loss_weight and --undesirable_loss_weight, parsed, through kto_method's loss (the
    reference live from --ref_pretrain) against the reference function with the same values."""
    from rlhfkit.data.unpaired import build_unpaired_samples

    samples, _ = build_unpaired_samples(unpaired_rows(5, seed=3), tokenizer, input_key="input", output_key="output",
                                        label_key="label", input_template="User: {}\nAssistant: ",
                                        apply_chat_template=False, max_len=64)
    attach_mismatched(samples, seed=0, max_len=64)
    for s in samples:  # the mismatched sequence: own prompt + the response of another sample
        assert s["kl_input_ids"][:s["prompt_len"]] == s["input_ids"][:s["prompt_len"]]
        assert s["kl_loss_mask"] != [] and sum(s["kl_loss_mask"]) > 0
    partners = [next(j for j, o in enumerate(samples) if o["input_ids"][o["prompt_len"]:]
                     == s["kl_input_ids"][s["prompt_len"]:]) for s in samples]
    assert sorted(partners) == list(range(5)) and all(i != j for i, j in enumerate(partners))
    batch = collate_kto(samples, tokenizer.pad_token_id)
    cfg = parse_config("kto", None, ["--pretrain", tiny_model_dir, "--ref_pretrain", other_model_dir, "--ref_mode",
                                     "live", "--dataset", "d", "--beta", "0.3", "--desirable_loss_weight", "1.5",
                                     "--undesirable_loss_weight", "0.5"])
    loss, metrics = kto_method(cfg, tokenizer, dist_info).loss(policy, batch)
    logps, _ = side_logps(policy, samples, *COMPLETION)
    kl, _ = side_logps(policy, samples, *MISMATCHED)
    ref, _ = side_logps(other, samples, *COMPLETION)
    ref_kl, _ = side_logps(other, samples, *MISMATCHED)
    desirable = torch.tensor([s["label"] for s in samples])
    assert 0 < int(desirable.sum()) < len(samples)  # both weights act
    expected, rewards, z = kto_loss(logps, ref, desirable, kl, ref_kl, beta=0.3, desirable_loss_weight=1.5,
                                    undesirable_loss_weight=0.5, reduction="sum")
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(metrics["kl"]) == pytest.approx(5 * float(z), abs=1e-4)
    sign = desirable.double() * 2 - 1
    assert float(metrics["signed_reward"]) == pytest.approx(float((sign * rewards).sum()), abs=1e-4)


def test_vanilla_kto_loss_through_the_parsed_config(policy, other, other_model_dir, tiny_model_dir, tokenizer,
                                                   dist_info):
    """kto --vanilla_loss, parsed, through kto_method's loss (reference live from --ref_pretrain) against the formula
    written here in float64: reference points from the other side's mean log-ratio, no mismatched pairs."""
    import math

    from rlhfkit.data.unpaired import build_unpaired_samples

    samples, _ = build_unpaired_samples(unpaired_rows(6, seed=5), tokenizer, input_key="input", output_key="output",
                                        label_key="label", input_template="User: {}\nAssistant: ",
                                        apply_chat_template=False, max_len=64)
    attach_mismatched(samples, seed=0, max_len=64)
    batch = collate_kto(samples, tokenizer.pad_token_id)
    cfg = parse_config("kto", None, ["--pretrain", tiny_model_dir, "--ref_pretrain", other_model_dir, "--ref_mode",
                                     "live", "--dataset", "d", "--beta", "0.3", "--vanilla_loss"])
    loss, metrics = kto_method(cfg, tokenizer, dist_info).loss(policy, batch)
    logps, _ = side_logps(policy, samples, *COMPLETION)
    ref, _ = side_logps(other, samples, *COMPLETION)
    r = (logps - ref).tolist()
    label = [bool(s["label"]) for s in samples]
    assert 0 < sum(label) < len(label)
    kl_d = max(0.0, math.fsum(x for x, d in zip(r, label) if d) / sum(label))
    kl_u = max(0.0, math.fsum(x for x, d in zip(r, label) if not d) / (len(label) - sum(label)))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = math.fsum(1 - sig(0.3 * (x - kl_u)) if d else 1 - sig(0.3 * (kl_d - x)) for x, d in zip(r, label))
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert "kl" not in metrics
    assert float(metrics["kl_desirable"]) == pytest.approx(6 * kl_d, abs=1e-4)
    assert float(metrics["kl_undesirable"]) == pytest.approx(6 * kl_u, abs=1e-4)
    default_cfg = parse_config("kto", None, ["--pretrain", tiny_model_dir, "--ref_pretrain", other_model_dir,
                                             "--ref_mode", "live", "--dataset", "d", "--beta", "0.3"])
    default_loss, _ = kto_method(default_cfg, tokenizer, dist_info).loss(policy, batch)
    assert float(default_loss) != pytest.approx(float(loss), rel=1e-6)  # the flag changes the loss


def test_kd_loss_equals_reference_function(policy, other, other_model_dir, tiny_model_dir, tokenizer, dist_info):
    """kd's --kd_coef 0.25 (parsed; the default is 0.4) through kd_method's loss: 0.75 NLL + 0.25 KL, float64."""
    from rlhfkit.data.sft import build_sft_samples

    samples, _ = build_sft_samples(echo_rows(3, seed=4), tokenizer, input_key="input", output_key="output",
                                   input_template="User: {}\nAssistant: ", apply_chat_template=False, max_len=64)
    from rlhfkit.data.collate import collate_padded

    batch = collate_padded(samples, tokenizer.pad_token_id)
    cfg = parse_config("kd", None, ["--pretrain", tiny_model_dir, "--teacher_model", other_model_dir, "--dataset", "d",
                                    "--kd_coef", "0.25"])
    loss, metrics = kd_method(cfg, tokenizer, dist_info).loss(policy, batch)
    # Reference: the full [B, T, V] functions in float64, with the whole batch's token count as the normaliser.
    student64, teacher64 = copy.deepcopy(policy).double(), copy.deepcopy(other).double()
    with torch.no_grad():
        s_logits = student64(**model_inputs(batch)).logits
        t_logits = teacher64(**model_inputs(batch)).logits
    nll = masked_lm_loss(s_logits, batch["input_ids"], batch["loss_mask"], num_tokens=1.0)
    kl = distillation_loss(s_logits[:, :-1], t_logits[:, :-1], batch["loss_mask"][:, 1:], num_tokens=1.0)
    assert nll.dtype == torch.float64
    assert float(metrics["nll"]) == pytest.approx(float(nll), rel=1e-5)
    assert float(metrics["kd_kl"]) == pytest.approx(float(kl), rel=1e-4)
    assert float(loss) == pytest.approx(float(0.75 * nll + 0.25 * kl), rel=1e-5)


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "soft"])
def test_prm_loss_equals_reference_function(policy, tiny_model_dir, tokenizer, soft, dist_info):
    """prm's --placeholder_token and --reward_tokens, parsed, through prm_samples and prm_method's loss: the
    cross-entropy over the two reward tokens at each placeholder, by hand."""
    rows = process_rows(3, seed=6)
    if soft:
        rows = [dict(r, label=[0.9 if x == "+" else 0.2 for x in r["label"]]) for r in rows]
    cfg = parse_config("prm", None, ["--pretrain", tiny_model_dir, "--dataset", "d", "--input_key", "input",
                                     "--label_key", "label", "--placeholder_token", "§", "--reward_tokens", "+", "-",
                                     "--max_len", "128"])
    samples, stats = prm_samples(cfg, tokenizer, rows)
    assert stats["label_kind"] == ("soft" if soft else "hard")
    placeholder, reward_ids = tokenizer.encode("§")[-1], [tokenizer.encode(t)[-1] for t in ("+", "-")]
    batch = collate_prm(samples, tokenizer.pad_token_id)
    loss, metrics = prm_method(cfg, tokenizer, dist_info).loss(policy, batch)
    steps = sum(s["num_steps"] for s in samples)
    with torch.no_grad():
        mean, acc = prm_token_loss(policy(**model_inputs(batch)).logits, batch["input_ids"], batch["labels"],
                                   placeholder_token_id=placeholder, reward_token_ids=reward_ids)
    assert float(loss) == pytest.approx(float(mean) * steps, rel=1e-5)
    assert float(metrics["accuracy"]) == pytest.approx(float(acc) * steps, abs=1e-4)
    # By hand, one unpadded row at a time, float64: cross-entropy over the two reward tokens at each placeholder.
    total = torch.zeros((), dtype=torch.float64)
    for s in samples:
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([s["input_ids"]])).logits[0].double()
        for t, (i, y) in enumerate(zip(s["input_ids"], s["labels"])):
            if i == placeholder:
                logp = torch.log_softmax(logits[t, reward_ids], -1)
                q = torch.tensor([y, 1 - y], dtype=torch.float64) if soft else \
                    torch.tensor([float(y == reward_ids[0]), float(y == reward_ids[1])], dtype=torch.float64)
                total -= (q * logp).sum()
    assert float(loss) == pytest.approx(float(total), rel=1e-5)
    packed_loss, packed_metrics = prm_batch_loss(policy, collate_prm(samples, tokenizer.pad_token_id, packed=True),
                                                 placeholder_token_id=placeholder, reward_token_ids=reward_ids)
    assert float(packed_loss) == pytest.approx(float(total), rel=1e-5)  # --packing_samples: the same steps
    assert float(packed_metrics["accuracy"]) == pytest.approx(float(metrics["accuracy"]), abs=1e-4)


@pytest.mark.parametrize("n,world,micro", [(7, 2, 3), (5, 4, 1), (3, 4, 2), (8, 2, 4), (1, 3, 5)])
def test_shard_chunks_cover_every_sample_once_with_equal_calls_per_rank(n, world, micro):
    from rlhfkit.trainers.sequence_logps import shard_chunks

    plans = [shard_chunks(n, rank, world, micro) for rank in range(world)]
    assert len({len(p) for p in plans}) == 1  # same number of (FSDP-collective) forwards on every rank
    assert sorted(i for p in plans for chunk in p for i in chunk) == list(range(n))
    assert all(len(chunk) <= micro for p in plans for chunk in p)


def test_packed_dpo_batch_gives_the_padded_loss_and_gradient(policy, other, pairs, tokenizer):
    """--packing_samples: the 2B sequences in one row (per-sequence positions) score exactly as padded rows."""
    padded_batch, packed_batch = (collate_pairs(pairs, tokenizer.pad_token_id, packed) for packed in (False, True))
    assert packed_batch["input_ids"].shape[0] == 1 and len(packed_batch["seq_lens"]) == 2 * len(pairs)
    grads = []
    for batch in (padded_batch, packed_batch):
        policy.zero_grad()
        loss, metrics = dpo_batch_loss(policy, batch, beta=0.1, nll_loss_coef=0.5, ref_model=other)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
        if batch is padded_batch:
            want_loss, want_metrics = float(loss.detach()), {k: float(v) for k, v in metrics.items()}
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-5)
    assert {k: float(v) for k, v in metrics.items()} == pytest.approx(want_metrics, rel=1e-4, abs=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    policy.zero_grad()


def test_packed_kto_batch_gives_the_padded_loss(policy, other, tokenizer):
    from rlhfkit.data.unpaired import build_unpaired_samples

    samples, _ = build_unpaired_samples(unpaired_rows(4, seed=8), tokenizer, input_key="input", output_key="output",
                                        label_key="label", input_template="User: {}\nAssistant: ",
                                        apply_chat_template=False, max_len=64)
    attach_mismatched(samples, seed=1, max_len=64)
    losses = [kto_batch_loss(policy, collate_kto(samples, tokenizer.pad_token_id, packed), beta=0.2,
                             ref_model=other)[0] for packed in (False, True)]
    assert float(losses[1]) == pytest.approx(float(losses[0]), rel=1e-5)


def test_packed_reward_model_batch_gives_the_padded_loss(tiny_reward_model_dir, pairs, tokenizer):
    """--packing_samples for rm: the reward is read at the end of each packed sequence."""
    from rlhfkit.models.loading import load_scalar_model

    model = load_scalar_model(tiny_reward_model_dir).eval()
    (padded, pm), (packed, km) = (rm_batch_loss(model, collate_rm(pairs, tokenizer.pad_token_id, p))
                                  for p in (False, True))
    assert float(packed) == pytest.approx(float(padded), rel=1e-5)
    assert float(km["reward_margin"]) == pytest.approx(float(pm["reward_margin"]), abs=1e-4)


def test_ref_mode_flag_precomputes_or_runs_the_reference_live(policy, other_model_dir, tiny_model_dir, tokenizer):
    """dpo's --ref_mode through the trainer's own code (dpo_samples, dpo_method): precompute (the default) attaches
    the reference's log-probs to the samples and the loss needs no model; --ref_mode live attaches none and the
    method runs the reference per batch; both give the same loss."""
    from rlhfkit.cli.dpo import GROUPS
    from rlhfkit.config.parse import parse_config
    from rlhfkit.engine.distributed import init_distributed
    from rlhfkit.trainers.dpo import dpo_method, dpo_samples

    rows = preference_rows(3, seed=5)
    base = ["--pretrain", tiny_model_dir, "--ref_pretrain", other_model_dir, "--dataset", "d",
            "--micro_train_batch_size", "2", "--beta", "0.1"]
    owned = not dist.is_initialized()
    try:
        dist_info = init_distributed()
        losses = {}
        for mode, extra in (("precompute", []), ("live", ["--ref_mode", "live"])):
            cfg = parse_config("dpo", GROUPS, base + extra)
            samples, _ = dpo_samples(cfg, tokenizer, rows)
            attached = [all(key in s for key in REF_KEYS) for s in samples]
            assert attached == [mode == "precompute"] * len(rows), mode
            method = dpo_method(cfg, tokenizer, dist_info)
            with torch.no_grad():
                losses[mode] = float(method.loss(policy, method.collate(samples))[0])
    finally:
        if owned:
            shutdown_distributed()
    assert losses["live"] == pytest.approx(losses["precompute"], rel=1e-5)
