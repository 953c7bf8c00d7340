"""fp32 master weights under a half-precision compute copy on one rank (`rlhfkit.engine.master_weights`): the same
arithmetic as FSDP2's mixed precision (which it replaces on one rank), fp32 gradient sums, updates far below bf16's
resolution kept, tied weights kept tied, and an exact resume through the real checkpoint files."""

from __future__ import annotations

import os

import pytest
import torch

from rlhfkit.engine.master_weights import MasterWeights, cast_parameters


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


def _step(model, params, optimizer, batches, master=None) -> None:
    for ids in batches:  # two micro-batches: gradients summed before the step
        model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master is not None:
        master.sync_to_model()


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
    master = MasterWeights(plain, torch.bfloat16)
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
    master = MasterWeights(model, torch.bfloat16)
    optimizer = torch.optim.SGD(master.masters.parameters(), lr=1.0)
    weight = dict(master.masters.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    compute = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    before = weight.detach().clone()
    ulp = torch.finfo(torch.bfloat16).eps * before.abs().max().item()
    for _ in range(40):  # 40 steps of a tenth of an ulp of the largest weight: each alone below bf16's resolution
        weight.grad = torch.full_like(weight, -ulp / 10)
        optimizer.step()
        master.sync_to_model()
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


def test_a_bf16_train_engine_resumes_exactly_from_its_checkpoint(tiny_model_dir, tmp_path, gloo):
    """TrainEngine in bf16 on one rank keeps masters; the checkpoint holds the fp32 masters and the optimizer state
    by their names, so a resumed engine's next step is bit-identical to the uninterrupted one's."""
    from types import SimpleNamespace

    from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint
    from rlhfkit.engine.distributed import DistInfo
    from rlhfkit.engine.train_engine import TrainEngine
    from rlhfkit.models.loading import load_causal_lm

    cfg = SimpleNamespace(gradient_checkpointing=False, zero_stage=2, param_dtype="bf16", adam_offload=False,
                          aux_loss_coef=0.0, learning_rate=1e-3, adam_betas=[0.9, 0.95], l2=0.0, lr_warmup_ratio=0.0,
                          lr_scheduler="constant", min_lr_ratio=0.0, max_norm=1.0, optim="adam", adam_eps=1e-8,
                          muon_lr=0.02, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    batches = _batches(128)

    def engine() -> TrainEngine:
        return TrainEngine(load_causal_lm(tiny_model_dir), cfg, dist, total_steps=10)

    def step(e: TrainEngine, ids: torch.Tensor) -> None:
        e.model(input_ids=ids, labels=ids).loss.backward()
        e.optimizer_step()

    a = engine()
    assert a.master is not None and a.state_model is a.master.masters
    step(a, batches[0])
    save_checkpoint(tmp_path, 1, a.state_model, a.optimizer, a.scheduler, {}, max_keep=1)
    step(a, batches[1])
    b = engine()
    load_checkpoint(tmp_path, b.state_model, b.optimizer, b.scheduler, seed=0)
    b.after_load()
    step(b, batches[1])
    for (name, pa), pb in zip(a.state_model.named_parameters(), b.state_model.parameters()):
        assert pa.dtype == torch.float32 and torch.equal(pa, pb), name
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert pa.dtype == torch.bfloat16 and torch.equal(pa, pb), name
