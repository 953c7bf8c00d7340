"""--optim muon: torch.optim.Muon for the hidden matrices, AdamW for the rest (rlhfkit/engine/muon.py). One engine step
against float64 references written from the formulas, the parameter split, a checkpoint round trip, FSDP2-sharded
Muon on 2 gloo ranks against the unsharded step, and a short SFT run that learns."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.config.parse import flags_to_argv, parse_config

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's) quintic


def newton_schulz64(u: torch.Tensor, steps: int) -> torch.Tensor:
    """X_0 = U / ||U||_F (transposed when tall); X <- a X + (b A + c A^2) X with A = X X^T; in float64."""
    a, b, c = NS_COEFFICIENTS
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon64(w, grads, lrs, *, momentum, nesterov, weight_decay, steps):
    """torch's Muon in float64: B <- mu B + (1 - mu) G; U = (1 - mu) G + mu B (nesterov) or B;
    W <- W (1 - lr wd) - lr sqrt(max(1, m / n)) NS(U)."""
    w, buf = w.double(), torch.zeros_like(w, dtype=torch.float64)
    for g, lr in zip(grads, lrs):
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        w = w * (1 - lr * weight_decay) - lr * math.sqrt(max(1.0, w.shape[0] / w.shape[1])) * newton_schulz64(u, steps)
    return w


def adamw64(w, grads, lrs, *, betas, eps, weight_decay):
    """AdamW: m, v moments, bias-corrected, decoupled decay W (1 - lr wd); in float64."""
    w = w.double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w * (1 - lr * weight_decay)
        w = w - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return w


def sft_engine(model_dir: str, flags: dict, total_steps: int = 4):
    from rlhfkit.cli.sft import GROUPS
    from rlhfkit.engine.distributed import DistInfo
    from rlhfkit.engine.train_engine import TrainEngine
    from rlhfkit.models.loading import load_causal_lm

    cfg = parse_config("sft", GROUPS, flags_to_argv(flags))
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return TrainEngine(load_causal_lm(model_dir), cfg, info, total_steps)


def _gaussian_grads(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


FLAGS = {"optim": "muon", "muon_lr": 0.05, "muon_momentum": 0.9, "learning_rate": 1e-3, "adam_betas": [0.8, 0.9],
         "adam_eps": 1e-6, "l2": 0.1, "max_norm": 0, "lr_scheduler": "constant", "lr_warmup_ratio": 0.5}


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_muon_step_matches_the_float64_formulas(tiny_model_dir, nesterov):
    """Two engine steps of --optim muon (warmup: factors 1/2 then 1 of --muon_lr and --learning_rate): a tall and a
    square hidden matrix follow Muon's formula (--muon_momentum, --muon_nesterov or --no-muon_nesterov,
    --muon_ns_steps 3 quintic Newton-Schulz steps (the default 5 without it), lr sqrt(max(1, m/n)), decoupled
    decay --l2), the embeddings and a
    norm weight follow AdamW (--adam_betas, --adam_eps, --l2 on 2-D only)."""
    flags = {**FLAGS, "muon_ns_steps": 3} if nesterov else {**FLAGS, "no-muon_nesterov": True}
    ns_steps = 3 if nesterov else 5
    engine = sft_engine(tiny_model_dir, flags)
    params = dict(engine.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = [_gaussian_grads(engine.model, seed) for seed in (1, 2)]
    for step_grads in grads:
        for name, p in params.items():
            p.grad = step_grads[name].clone()
        engine.optimizer_step()
    muon_lrs, adam_lrs = [0.025, 0.05], [5e-4, 1e-3]
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        expected = muon64(before[name], [g[name] for g in grads], muon_lrs, momentum=0.9, nesterov=nesterov,
                          weight_decay=0.1, steps=ns_steps)
        delta, want = params[name].detach().double() - before[name].double(), expected - before[name].double()
        # torch runs Newton-Schulz in bfloat16: within 3% of the largest update entry; the formula without the
        # sqrt(m/n) lr adjustment, or with the other momentum form, is farther off than that
        tolerance = 0.03 * want.abs().max()
        assert (delta - want).abs().max() < tolerance, name
        other = muon64(before[name], [g[name] for g in grads], muon_lrs, momentum=0.9, nesterov=not nesterov,
                       weight_decay=0.1, steps=5) - before[name].double()
        assert (delta - other).abs().max() > 3 * tolerance, name
        if "up_proj" in name:  # 128 x 64: lr x sqrt(2)
            assert (delta - want / math.sqrt(2)).abs().max() > 3 * tolerance
    for name, decay in (("model.embed_tokens.weight", 0.1), ("model.norm.weight", 0.0)):
        expected = adamw64(before[name], [g[name] for g in grads], adam_lrs, betas=(0.8, 0.9), eps=1e-6,
                           weight_decay=decay)
        assert torch.allclose(params[name].detach().double(), expected, rtol=0, atol=1e-6), name


def test_the_muon_parameter_split(tiny_model_dir, tiny_reward_model_dir):
    """Muon: the attention and MLP projections (LoRA's A and B when LoRA trains); AdamW with --l2: the embeddings
    (tied with lm_head) and a critic's `score` head; AdamW without decay: the norms."""
    from rlhfkit.engine.muon import muon_parameters
    from rlhfkit.models.loading import load_causal_lm, load_scalar_model
    from rlhfkit.models.lora import apply_lora

    def split(model):
        names = {id(p): n for n, p in model.named_parameters()}
        return [sorted(names[id(p)] for p in part) for part in muon_parameters(model)]

    muon, decay, no_decay = split(load_causal_lm(tiny_model_dir))
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj"]
    assert muon == sorted(f"model.layers.{i}.{p}.weight" for i in range(2) for p in projections)
    assert decay == ["model.embed_tokens.weight"]
    assert no_decay and all("norm" in n for n in no_decay)
    muon, decay, _ = split(load_scalar_model(tiny_reward_model_dir))
    assert decay == ["model.embed_tokens.weight", "score.weight"] and len(muon) == 14
    lora = split(apply_lora(load_causal_lm(tiny_model_dir), 4, 8, ["q_proj", "v_proj"], 0.0))
    assert len(lora[0]) == 8 and all("lora_A" in n or "lora_B" in n for n in lora[0]) and lora[1:] == [[], []]
    engine = sft_engine(tiny_model_dir, {"optim": "muon", "l2": 0.05})
    kinds = [(g["kind"], len(g["params"]), g["weight_decay"]) for g in engine.optimizer.param_groups]
    assert kinds == [("adamw", 1, 0.05), ("adamw", len(no_decay), 0.0), ("muon", 14, 0.05)]
    assert isinstance(engine.optimizer._inner["muon"], torch.optim.Muon)
    assert type(sft_engine(tiny_model_dir, {}).optimizer) is torch.optim.AdamW  # --optim adam (the default)


@pytest.mark.slow
def test_fsdp2_sharded_muon_orthogonalises_the_whole_matrix(tiny_model_dir, tmp_path):
    """2 gloo ranks, FSDP2 shards each matrix by rows (Shard(0)): torch's Muon on the DTensor shards gives the
    whole-matrix Newton-Schulz update (float64 formula, bf16 tolerance), not one per rank's rows."""
    import os

    settings = {"optim": "muon", "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "max_norm": 0.0,
                "lr_scheduler": "constant", "lr_warmup_ratio": 0.0, "min_lr_ratio": 0.0, "muon_lr": 0.05,
                "muon_momentum": 0.9, "muon_ns_steps": 5, "muon_nesterov": True}
    out = tmp_path / "sharded.pt"
    script = Path(__file__).with_name("_muon_sharded.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           tiny_model_dir, str(out), json.dumps(settings)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(out)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        w = saved["before"][name]
        assert saved["local_rows"][name] == w.shape[0] // 2  # rank 0 held half the rows
        grads = []
        for seed in (1, 2):  # the script draws every parameter's gradient in named_parameters order
            gen = torch.Generator().manual_seed(seed)
            grads.append({n: torch.randn(p.shape, generator=gen) for n, p in saved["before"].items()}[name])
        kw = {"momentum": 0.9, "nesterov": True, "weight_decay": 0.0, "steps": 5}
        want = muon64(w, grads, [0.05, 0.05], **kw) - w.double()
        per_rank = torch.cat([muon64(part, [g.chunk(2)[i] for g in grads], [0.05, 0.05], **kw)
                              for i, part in enumerate(w.chunk(2))]) - w.double()
        delta = saved["after"][name].double() - w.double()
        tolerance = 0.03 * want.abs().max()
        assert (delta - want).abs().max() < tolerance, name
        assert (delta - per_rank).abs().max() > 3 * tolerance, name


@pytest.mark.slow
def test_sft_with_muon_learns_and_resumes_its_momentum_exactly(tiny_model_dir, tmp_path):
    """8 SFT steps with --optim muon and --learning_rate 0 (AdamW's embeddings and norms frozen: only the Muon
    matrices learn) lower the held-out loss after each epoch; resumed from the step-4 checkpoint (model, both
    optimizers' state through DCP, schedule), steps 5-8 repeat the uninterrupted losses, momentum included."""
    import shutil

    from rlhfkit.cli.sft import main as sft_main
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    train = write_jsonl(echo_rows(16, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(echo_rows(8, seed=2), tmp_path / "eval.jsonl")

    def run(name: str, **extra) -> list[dict]:
        flags = {"pretrain": tiny_model_dir, "dataset": train, "output_key": "output", "max_len": 48,
                 "train_batch_size": 4, "micro_train_batch_size": 4, "max_epochs": 2, "optim": "muon",
                 "muon_lr": 0.05, "muon_momentum": 0.95, "learning_rate": 0.0, "lr_warmup_ratio": 0.0,
                 "save_steps": 4, "ckpt_path": str(tmp_path / name / "ckpt"), "max_ckpt_num": 5,
                 "run_dir": str(tmp_path / name / "run"), "save_path": str(tmp_path / name / "hf"), **extra}
        sft_main(flags_to_argv(flags))
        return [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]

    rows = run("full", eval_dataset=held_out)
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2] and evals[0] - evals[2] > 0.1, evals  # 10.76 -> 10.58
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    (tmp_path / "resumed" / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "ckpt" / "global_step4", tmp_path / "resumed" / "ckpt" / "global_step4")
    resumed = {r["step"]: r["train/loss"] for r in run("resumed", load_checkpoint=True) if "train/loss" in r}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), (step, resumed[step], losses[step])
