"""fp32 master weights under a half-precision compute copy on one rank (`rlhfkit.engine.master_weights`): the same
arithmetic as FSDP2's mixed precision (which it replaces on one rank), fp32 gradient sums, updates far below bf16's
resolution kept, tied weights kept tied, and an exact resume through the real checkpoint files."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from rlhfkit.engine.master_weights import (
    MasterWeights,
    RandomBits,
    RoundingScratch,
    cast_parameters,
    stochastic_round_to_bf16,
)


@pytest.fixture(scope="module")
def gloo():
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29547")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield


def _batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (4, 24), generator=g) for _ in range(2)]


def _bf16_engine(model_dir, **flags):
    """A TrainEngine in bf16 on one rank (so with master weights) over the tiny model; `flags` change the defaults."""
    from types import SimpleNamespace

    from rlhfkit.engine.distributed import DistInfo
    from rlhfkit.engine.train_engine import TrainEngine
    from rlhfkit.models.loading import load_causal_lm

    cfg = SimpleNamespace(**{**dict(gradient_checkpointing=False, zero_stage=2, param_dtype="bf16", adam_offload=False,
                                    aux_loss_coef=0.0, learning_rate=1e-3, adam_betas=[0.9, 0.95], l2=0.0,
                                    lr_warmup_ratio=0.0, lr_scheduler="constant", min_lr_ratio=0.0, max_norm=1.0,
                                    optim="adam", adam_eps=1e-8, muon_lr=0.02, muon_momentum=0.95, muon_ns_steps=5,
                                    muon_nesterov=True, master_weights_rounding="stochastic", seed=7), **flags})
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return TrainEngine(load_causal_lm(model_dir), cfg, dist, total_steps=10)


def _step(model, params, optimizer, batches, master=None, step=1) -> None:
    for ids in batches:  # two micro-batches: gradients summed before the step
        model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        master.sync_to_model(step)


def test_one_step_equals_fsdp2_mixed_precision_on_one_rank(tiny_model_dir, gloo):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from rlhfkit.engine.fsdp import decoder_layers
    from rlhfkit.models.loading import load_causal_lm

    fsdp = load_causal_lm(tiny_model_dir)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(fsdp):
        fully_shard(layer, mp_policy=policy)
    fully_shard(fsdp, mp_policy=policy)
    plain = load_causal_lm(tiny_model_dir)
    master = MasterWeights(plain, torch.bfloat16, rounding="nearest")
    assert all(p.dtype == torch.bfloat16 for p in plain.parameters())
    assert all(p.dtype == torch.float32 for p in master.masters.parameters())
    assert all(b.dtype == torch.float32 for b in plain.buffers() if b.is_floating_point())  # buffers stay fp32
    batches = _batches(plain.config.vocab_size)
    opt_fsdp = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    opt_master = torch.optim.AdamW(master.masters.parameters(), lr=1e-2)
    initial = {n: p.detach().clone() for n, p in master.masters.named_parameters()}
    _step(fsdp, list(fsdp.parameters()), opt_fsdp, batches)
    _step(plain, list(master.masters.parameters()), opt_master, batches, master)
    theirs = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    moved = 0.0
    for name, mine in master.masters.named_parameters():
        step = (theirs[name] - initial[name]).abs().max().item()
        moved = max(moved, step)
        # the same bf16 forward/backward and fp32 sums; kernels may order a sum differently: within 2% of a step
        assert (mine - theirs[name]).abs().max().item() <= 0.02 * max(step, 1e-12) + 1e-7, name
    assert moved > 1e-3  # the step moved the weights, so agreeing is not trivial
    for (name, param), master_param in zip(plain.named_parameters(), master.masters.parameters()):
        assert torch.equal(param, master_param.to(torch.bfloat16)), name  # the compute copy is the rounded master


def test_updates_below_bf16_resolution_accumulate_in_the_masters(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    master = MasterWeights(model, torch.bfloat16, rounding="nearest")
    optimizer = torch.optim.SGD(master.masters.parameters(), lr=1.0)
    weight = dict(master.masters.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    compute = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    before = weight.detach().clone()
    ulp = torch.finfo(torch.bfloat16).eps * before.abs().max().item()
    for i in range(40):  # 40 steps of a tenth of an ulp of the largest weight: each alone below bf16's resolution
        weight.grad = torch.full_like(weight, -ulp / 10)
        optimizer.step()
        master.sync_to_model(i + 1)
    assert (weight - before).min().item() == pytest.approx(4 * ulp, rel=1e-3)  # the fp32 master kept every step
    assert torch.equal(compute, weight.detach().to(torch.bfloat16))
    assert (compute.float() - before.to(torch.bfloat16).float()).abs().max().item() > 0  # and the copy moved


def test_gradients_are_summed_in_fp32_and_ties_stay_tied(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    master = MasterWeights(model, torch.bfloat16)
    assert (master.masters.lm_head.weight is master.masters.model.embed_tokens.weight) == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = _batches(model.config.vocab_size)
    grads = []
    for batch in ids:
        model(input_ids=batch, labels=batch).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # moved to the master at once
        grads.append({n: p.grad.clone() for n, p in master.masters.named_parameters()})
    name = "model.layers.1.self_attn.o_proj.weight"
    assert grads[1][name].dtype == torch.float32 and not torch.equal(grads[0][name], grads[1][name])


def test_cast_parameters_leaves_buffers(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    model = cast_parameters(load_causal_lm(tiny_model_dir), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} <= {torch.float32}


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above |x| in magnitude (float64), from the fp32 bit pattern by hand."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
    low = (bits // 65536) * 65536  # non-negative patterns only (the test uses |x|)
    as_float = lambda b: b.to(torch.int32).view(torch.float32).to(torch.float64)  # noqa: E731
    return as_float(low), as_float(low + 65536)


@pytest.mark.parametrize("source", ["counter", "torch"])
@pytest.mark.parametrize("chunk", [None, 4096])
def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds_float64(chunk, source):
    """Every element, and each of the four 16-bit lanes a torch draw of 64 bits is cut into (the fourth holds the
    draw's top bits, the sign bit of torch's signed draws), rounds up with the odds of its distance to the lower
    neighbour; with a 4096-element chunk the 20,003 elements take five chunks and a tail (torch), and three threads
    (counter). Both sources of random bits: the counter kernel (a CPU's default) and a torch generator (a GPU's,
    here on the CPU)."""
    g = RandomBits([0], "cpu", source=source)
    n = 20003
    scratch = RoundingScratch("cpu", chunk, threads=3) if chunk else None
    spots = torch.tensor([0.05, 0.7, 3.0, 1e-3, 123.0], dtype=torch.float32)
    for sign in (1.0, -1.0):
        for base in spots:
            low, high = _bf16_neighbours(base.reshape(1))
            for frac in (0.1, 0.37, 0.5, 0.9):
                x64 = low + frac * (high - low)
                x = x64.to(torch.float32).expand(n).clone() * sign
                out = stochastic_round_to_bf16(x, g, scratch=scratch).to(torch.float64) * sign  # magnitudes
                assert set(out.unique().tolist()) <= {low.item(), high.item()}
                exact_frac = ((x64.to(torch.float32).to(torch.float64) - low) / (high - low)).item()
                for lane in (slice(None), slice(0, None, 4), slice(1, None, 4), slice(2, None, 4), slice(3, None, 4)):
                    up_lane = (out[lane] == high).double()
                    sigma = (exact_frac * (1 - exact_frac) / len(up_lane)) ** 0.5
                    assert abs(up_lane.mean().item() - exact_frac) < 5 * sigma + 2 ** -16, (base.item(), frac, sign,
                                                                                          lane)
    representable = torch.tensor([0.5, -0.75, 1.0, 0.0], dtype=torch.float32)
    assert torch.equal(stochastic_round_to_bf16(representable, g), representable.to(torch.bfloat16))


def _splitmix64_word(key: int, position: int) -> int:
    """The top 16 bits of SplitMix64's output for the state key + position x 0x9E3779B97F4A7C15, in Python ints."""
    mask = (1 << 64) - 1
    z = (key + position * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 48


@pytest.mark.parametrize("threads", [1, 3])
def test_the_counter_source_is_splitmix64_and_one_stream_across_calls_and_threads(threads):
    """Word p of the counter stream is SplitMix64's top 16 bits at state key + p x golden (computed here in Python
    ints), whatever the thread split; a second call continues the stream where the first stopped. Checked on the
    bits: rounding fp32 patterns whose low 16 bits are 0x8000 rounds up exactly where the word is >= 0x8000."""
    n, first = 70001, 1234  # above the size rounded in parallel parts
    x = (((torch.arange(n, dtype=torch.int32) % 200) << 16) + 0x3F008000).view(torch.float32)  # halfway patterns
    bits = RandomBits([5, 9], "cpu", source="counter")
    scratch = RoundingScratch("cpu", threads=threads)
    head = stochastic_round_to_bf16(x[:first], bits, scratch=scratch)
    tail = stochastic_round_to_bf16(x[first:], bits, scratch=scratch)
    up = torch.cat([head, tail]).view(torch.int16).to(torch.int32) & 0xFFFF != (x.view(torch.int32) >> 16) & 0xFFFF
    for p in list(range(0, 40)) + list(range(first - 5, first + 5)) + list(range(n - 40, n)) + list(range(0, n, 997)):
        assert bool(up[p]) == (_splitmix64_word(bits.key, p) >= 0x8000), p
    assert bits.position == n


def test_stochastic_rounding_hands_sub_resolution_updates_to_the_compute_copy(tiny_model_dir):
    """Three updates of 0.1 spacing each, away from zero (so the spacing above each start is the one that counts):
    round-to-nearest leaves every compute weight at its start (0.3 < 0.5 of a spacing), stochastic rounding moves
    each by one spacing with probability 0.3, so 0.3 spacing on average (unbiased)."""
    from rlhfkit.models.loading import load_causal_lm

    name = "model.layers.0.mlp.up_proj.weight"
    moved = {}
    for rounding in ("nearest", "stochastic"):
        model = cast_parameters(load_causal_lm(tiny_model_dir), torch.bfloat16)  # a bf16-representable start,
        cast_parameters(model, torch.float32)                                     # as from a bf16 checkpoint
        master = MasterWeights(model, torch.bfloat16, rounding=rounding, seed=3)
        weight = dict(master.masters.named_parameters())[name]
        compute = dict(model.named_parameters())[name]
        start = weight.detach().clone().to(torch.float64)
        assert (start != 0).all()
        low, high = _bf16_neighbours(start.abs().to(torch.float32))
        assert torch.equal(low, start.abs())
        spacing, direction = high - low, start.sign()
        for i in range(3):
            with torch.no_grad():
                weight.copy_((start + (i + 1) * 0.1 * spacing * direction).to(torch.float32))
            master.sync_to_model(i + 1)
        moved[rounding] = (compute.detach().double() - start) * direction / spacing
    assert moved["nearest"].abs().max().item() == 0.0
    assert set(moved["stochastic"].unique().tolist()) == {0.0, 1.0}  # a neighbour, never further
    mean, n = moved["stochastic"].mean().item(), moved["stochastic"].numel()
    assert abs(mean - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5 + 1e-3, mean


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_bf16_train_engine_resumes_exactly_from_its_checkpoint(tiny_model_dir, tmp_path, gloo, rounding):
    """TrainEngine in bf16 on one rank keeps masters; the checkpoint holds the fp32 masters and the optimizer state
    by their names, so a resumed engine's next step is bit-identical to the uninterrupted one's."""
    from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint
    from rlhfkit.engine.train_engine import TrainEngine

    batches = _batches(128)

    def engine() -> TrainEngine:
        return _bf16_engine(tiny_model_dir, master_weights_rounding=rounding)

    def step(e: TrainEngine, ids: torch.Tensor) -> None:
        e.model(input_ids=ids, labels=ids).loss.backward()
        e.optimizer_step()

    a = engine()
    assert a.master is not None and a.state_model is a.master.masters
    step(a, batches[0])
    step(a, batches[1])
    save_checkpoint(tmp_path, 2, a.state_model, a.optimizer, a.scheduler, {}, max_keep=1)
    step(a, batches[0])
    b = engine()
    load_checkpoint(tmp_path, b.state_model, b.optimizer, b.scheduler, seed=0)
    b.after_load()
    step(b, batches[0])
    for (name, pa), pb in zip(a.state_model.named_parameters(), b.state_model.parameters()):
        assert pa.dtype == torch.float32 and torch.equal(pa, pb), name
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert pa.dtype == torch.bfloat16 and torch.equal(pa, pb), name


def test_master_weights_rounding_flag_decides_how_the_engine_rounds(tiny_model_dir, gloo):
    """--master_weights_rounding through TrainEngine: after a step far below bf16's resolution, `nearest` leaves the
    compute copy the round-to-nearest of the masters; `stochastic` (its AdamW step and rounding in one pass on a CPU)
    gives each weight one of its two bf16 neighbours, not always the nearest, and its average moved like the masters'
    (float64)."""
    from rlhfkit.config.parse import parse_config
    from rlhfkit.engine.distributed import DistInfo
    from rlhfkit.engine.train_engine import TrainEngine
    from rlhfkit.models.loading import load_causal_lm

    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    ids = _batches(128)[0]
    copies = {}
    for rounding in ("nearest", "stochastic"):
        cfg = parse_config("sft", None, ["--pretrain", str(tiny_model_dir), "--dataset", "unused.jsonl",
                                         "--param_dtype", "bf16", "--learning_rate", "1e-6", "--lr_warmup_ratio",
                                         "0", "--lr_scheduler", "constant", "--seed", "1",
                                         *(["--master_weights_rounding", "nearest"] if rounding == "nearest" else [])])
        assert cfg.master_weights_rounding == rounding
        engine = TrainEngine(load_causal_lm(tiny_model_dir), cfg, dist, total_steps=4)
        assert engine.master is not None
        # stochastic on a CPU: the AdamW step and the rounding in one pass (rlhfkit.engine.adamw_round)
        assert engine.steps_and_rounds == (rounding == "stochastic")
        engine.model(input_ids=ids, labels=ids).loss.backward()
        with warnings.catch_warnings():  # the one-pass step counts as the optimizer's step for the scheduler
            warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step")
            engine.optimizer_step()
        name = "model.layers.0.self_attn.q_proj.weight"
        copies[rounding] = (dict(engine.model.named_parameters())[name].detach().double(),
                            dict(engine.state_model.named_parameters())[name].detach().double())
    compute, master = copies["nearest"]
    assert torch.equal(compute, master.to(torch.bfloat16).double())
    compute, master = copies["stochastic"]
    nearest = master.to(torch.bfloat16).double()
    assert not torch.equal(compute, nearest)  # some weights went to their farther neighbour
    assert ((compute - master).abs() <= master.abs() * 2.0 ** -7 + 1e-30).all()  # within one spacing: a neighbour
    err_sr, err_rn = (compute - master).mean().item(), (nearest - master).abs().mean().item()
    assert abs(err_sr) < 0.1 * err_rn  # unbiased on average; each error is about one rounding error in size


def test_kept_gradient_buffers_carry_nothing_into_the_next_step(tiny_model_dir, gloo):
    """The masters' fp32 gradient buffers live across steps: the next step's first micro-batch overwrites them (no
    earlier gradient leaks in), a master that no micro-batch reaches has no gradient, so the optimizer leaves it
    as it is (what zero_grad(set_to_none=True) gave), and the buffers are the same memory every step."""
    e = _bf16_engine(tiny_model_dir, l2=0.1, max_norm=0.0, master_weights_rounding="nearest")
    assert e.master is not None
    ids = _batches(128)[0]
    e.model(input_ids=ids, labels=ids).loss.backward()  # step 1: every weight gets a gradient
    head, master_head = e.model.lm_head.weight, e.master.masters.lm_head.weight
    buffer = master_head.grad.data_ptr()
    e.optimizer_step()
    before = {n: p.detach().clone() for n, p in e.master.masters.named_parameters()}
    # step 2: only the lm_head's weight (tied or not) takes part: d/dw sum(w^2) = 2w
    (head.float() ** 2).sum().backward()
    assert torch.equal(master_head.grad, (2 * head.detach().float()).bfloat16().float())  # no step-1 gradient in it
    assert master_head.grad.data_ptr() == buffer
    e.optimizer_step()
    names = {n for n, p in e.master.masters.named_parameters() if p is master_head}
    for name, param in e.master.masters.named_parameters():
        if name in names:
            assert not torch.equal(param, before[name]), name
        else:  # no gradient this step: untouched, weight decay included
            assert torch.equal(param, before[name]), name


@pytest.mark.parametrize("keep", [True, False])
def test_gradient_buffers_are_kept_only_where_asked(tiny_model_dir, keep):
    """`keep_buffers` (a CPU's masters: True; elsewhere False): after `end_step` the masters' gradients stay allocated
    for the next step, or are freed as zero_grad(set_to_none=True) frees them."""
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    master = MasterWeights(model, torch.bfloat16)
    assert master.keep_buffers  # a CPU model
    master.keep_buffers = keep
    ids = _batches(model.config.vocab_size)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    master.masters_with_grads()
    assert all(p.grad is not None for p in master.masters.parameters())
    master.end_step()
    assert all((p.grad is not None) == keep for p in master.masters.parameters())


def test_the_engine_folds_its_clip_into_the_fused_step_and_leaves_no_scale_behind(tiny_model_dir):
    """A bf16 TrainEngine (fused AdamW on fp32 masters) clips through the optimizer's grad_scale. Adam's first step
    moves each weight by lr x g / (|g| + eps): about lr unclipped, at most lr x 0.1 once the gradient is clipped to a
    norm of 1e-9 (every |g| < eps = 1e-8). The report says the clipped norm is max_norm, and the optimizer carries no
    grad_scale afterwards (the next step, or an optimizer that does not read it, sees none)."""
    moved = {}
    for max_norm in (1e6, 1e-9):
        engine = _bf16_engine(tiny_model_dir, max_norm=max_norm)
        ids = torch.randint(0, engine.model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        engine.model(input_ids=ids, labels=ids).loss.backward()
        report: dict[str, float] = {}
        norm = engine.optimizer_step(report)
        assert report["grad_norm_after_clip"] == pytest.approx(min(norm, max_norm), rel=1e-4)
        assert not hasattr(engine.optimizer, "grad_scale")
        moved[max_norm] = report["update_max_abs"]
    lr = 1e-3
    assert moved[1e6] > 0.5 * lr and moved[1e-9] < 0.11 * lr, moved
