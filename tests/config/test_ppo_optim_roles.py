"""ppo's per-role optimiser flags (--actor_* / --critic_*, unset: the shared flag) reach the torch optimizer, the
lr schedule and the gradient clipping of real actor and critic workers (rlhfkit.rl.worker.ModelWorker, run in this
process on a 1-rank gloo group, `init_model` as the driver calls it)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError

TOTAL = 10
BASE = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "actor_learning_rate": 1e-3,
        "critic_learning_rate": 2e-3}


def ppo_cfg(**flags):
    return parse_config("ppo", GROUPS, flags_to_argv({**BASE, **flags}))


@pytest.fixture
def workers(tiny_model_dir, monkeypatch):
    """make(cfg) -> the engines of an actor and a critic worker built from `cfg`."""
    from rlhfkit.engine.distributed import free_port
    from rlhfkit.rl.worker import ModelWorker

    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)  # the worker sets these as Ray's would; restored after the test
    owned = not dist.is_initialized()

    def make(cfg) -> dict:
        values = dataclasses.replace(cfg, torch_threads_per_worker=torch.get_num_threads())
        engines = {}
        for role, lr, scalar in (("actor", cfg.actor_learning_rate, False), ("critic", cfg.critic_learning_rate, True)):
            worker = ModelWorker(role, values, 0, 1, "127.0.0.1", port)
            worker.init_model(tiny_model_dir, True, TOTAL, lr, scalar)
            engines[role] = worker.engine
        return engines

    yield make
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def lr_curve(peak: float, schedule: str, warmup_ratio: float, floor: float) -> list[float]:
    """Linear warmup over ceil(TOTAL x ratio) steps, then the schedule's closed form."""
    warmup = math.ceil(TOTAL * warmup_ratio)
    out = []
    for step in range(TOTAL):
        if step < warmup:
            out.append(peak * (step + 1) / warmup)
            continue
        p = (step - warmup) / (TOTAL - warmup)
        factor = {"constant": 1.0, "linear": 1 - p}.get(schedule)
        if factor is None:
            low = floor if schedule == "cosine_with_min_lr" else 0.0
            factor = low + (1 - low) * 0.5 * (1 + math.cos(math.pi * p))
        out.append(peak * factor)
    return out


def schedule_of(engine) -> list[list[float]]:
    """Each param group's lr at steps 0..TOTAL-1, from the worker's own LambdaLR."""
    sched = engine.scheduler
    return [[base * sched.lr_lambdas[i](s) for s in range(TOTAL)] for i, base in enumerate(sched.base_lrs)]


def clipped_norm(engine) -> float:
    """The global norm of the gradients the optimizer's step applies after optimizer_step's clipping (every gradient
    1): the gradients divided by the optimizer's grad_scale where the clip is folded into torch's fused AdamW."""
    params = list(engine.model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    seen = {}
    step = engine.optimizer.step

    def spy(*args, **kwargs):
        divisor = float(getattr(engine.optimizer, "grad_scale", 1.0))
        seen["norm"] = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item() / divisor
        return step(*args, **kwargs)

    engine.optimizer.step = spy
    engine.optimizer_step()
    return seen["norm"]


def adamw_groups(engine) -> list[dict]:
    return [g for g in engine.optimizer.param_groups if g.get("kind", "adamw") == "adamw"]


def test_per_role_flags_reach_each_workers_optimizer_schedule_and_clipping(workers):
    cfg = ppo_cfg(actor_optim="muon", actor_muon_lr=0.04, actor_muon_momentum=0.8, actor_muon_ns_steps=3,
                  **{"no-actor_muon_nesterov": True}, actor_adam_betas=[0.7, 0.8], actor_adam_eps=1e-5,
                  actor_l2=0.2, actor_max_norm=0.3, actor_lr_scheduler="linear", actor_lr_warmup_ratio=0.2,
                  actor_min_lr_ratio=0.9, critic_optim="muon", critic_muon_lr=0.01, critic_muon_momentum=0.5,
                  critic_muon_ns_steps=7, critic_muon_nesterov=True, critic_adam_betas=[0.6, 0.99],
                  critic_adam_eps=1e-7, critic_l2=0.01, critic_max_norm=0.7, critic_lr_scheduler="constant",
                  critic_lr_warmup_ratio=0.5, critic_min_lr_ratio=0.3, muon_nesterov=False)
    engines = workers(cfg)
    actor, critic = engines["actor"], engines["critic"]
    # each role: Muon for the hidden matrices (--<role>_muon_*, decay --<role>_l2), AdamW (--<role>_adam_*,
    # --<role>_l2 on the matrices only) for the rest; --critic_muon_nesterov over the shared --no-muon_nesterov
    for engine, muon_settings, adam_settings in (
            (actor, (0.04, 0.8, 3, False, 0.2), [(1e-3, (0.7, 0.8), 1e-5, 0.2), (1e-3, (0.7, 0.8), 1e-5, 0.0)]),
            (critic, (0.01, 0.5, 7, True, 0.01), [(2e-3, (0.6, 0.99), 1e-7, 0.01), (2e-3, (0.6, 0.99), 1e-7, 0.0)])):
        assert isinstance(engine.optimizer._inner["muon"], torch.optim.Muon)
        [muon] = [g for g in engine.optimizer.param_groups if g["kind"] == "muon"]
        assert (muon["initial_lr"], muon["momentum"], muon["ns_steps"], muon["nesterov"],
                muon["weight_decay"]) == muon_settings
        assert [(g["initial_lr"], g["betas"], g["eps"], g["weight_decay"]) for g in adamw_groups(engine)] == (
            adam_settings)
    # the critic's value head stays with AdamW
    score = critic.model.score.weight
    assert any(p is score for p in adamw_groups(critic)[0]["params"])
    # schedules: --actor_lr_scheduler linear with 20% warmup (both of the actor's lrs), --critic_lr_scheduler
    # constant after 50% warmup, not the shared --lr_scheduler's cosine_with_min_lr (no min-lr floor touches either)
    actor_lrs, critic_lrs = schedule_of(actor), schedule_of(critic)
    assert actor_lrs[0] == pytest.approx(lr_curve(1e-3, "linear", 0.2, 0.9), rel=1e-12)
    assert actor_lrs[-1] == pytest.approx(lr_curve(0.04, "linear", 0.2, 0.9), rel=1e-12)
    assert critic_lrs[0] == pytest.approx(lr_curve(2e-3, "constant", 0.5, 0.3), rel=1e-12)
    assert critic_lrs[-1] == pytest.approx(lr_curve(0.01, "constant", 0.5, 0.3), rel=1e-12)
    # clipping: --actor_max_norm 0.3, --critic_max_norm 0.7
    assert clipped_norm(actor) == pytest.approx(0.3, rel=1e-5)
    assert clipped_norm(critic) == pytest.approx(0.7, rel=1e-5)


def test_unset_role_flags_inherit_the_shared_ones(workers):
    """With no --actor_* / --critic_* flag both roles take the shared flags (--optim, --muon_lr, --adam_betas,
    --adam_eps, --l2, --max_norm, --lr_scheduler, --lr_warmup_ratio, --min_lr_ratio), as before these flags existed;
    one role's flag leaves the other role on the shared value."""
    defaults = workers(ppo_cfg())
    for role, lr in (("actor", 1e-3), ("critic", 2e-3)):  # the defaults: OpenRLHF's
        engine = defaults[role]
        assert type(engine.optimizer) is torch.optim.AdamW
        assert [(g["betas"], g["eps"], g["weight_decay"]) for g in engine.optimizer.param_groups] == [
            ((0.9, 0.95), 1e-8, 0.0), ((0.9, 0.95), 1e-8, 0.0)]
        assert schedule_of(engine)[0] == pytest.approx(lr_curve(lr, "cosine_with_min_lr", 0.03, 0.1), rel=1e-12)
        assert clipped_norm(engine) == pytest.approx(1.0, rel=1e-5)
    shared = workers(ppo_cfg(optim="muon", muon_lr=0.03, muon_momentum=0.9, adam_betas=[0.85, 0.9], adam_eps=1e-6,
                             l2=0.05, max_norm=0.5, lr_scheduler="constant", lr_warmup_ratio=0.0, min_lr_ratio=0.2,
                             critic_optim="adam"))
    actor, critic = shared["actor"], shared["critic"]
    [muon] = [g for g in actor.optimizer.param_groups if g["kind"] == "muon"]
    assert (muon["lr"], muon["momentum"], muon["weight_decay"]) == (0.03, 0.9, 0.05)
    assert type(critic.optimizer) is torch.optim.AdamW  # --critic_optim adam over the shared --optim muon
    for engine, lr in ((actor, 1e-3), (critic, 2e-3)):
        assert [(g["betas"], g["eps"], g["weight_decay"]) for g in adamw_groups(engine)] == [
            ((0.85, 0.9), 1e-6, 0.05), ((0.85, 0.9), 1e-6, 0.0)]
        assert schedule_of(engine)[0] == pytest.approx([lr] * TOTAL, rel=1e-12)
        assert clipped_norm(engine) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize(("flags", "message"), [
    ({"critic_adam_eps": 1e-6, "critic_max_norm": 0.5, "advantage_estimator": "group_norm",
      "n_samples_per_prompt": 2}, r"--critic_adam_eps, --critic_max_norm: this run trains no critic"),
    ({"actor_lr_warmup_ratio": 1.5}, r"--actor_lr_warmup_ratio 1.5: must lie in \[0, 1\]"),
    ({"critic_adam_betas": [0.9, 0.95, 0.99]}, r"--critic_adam_betas 0.9 0.95 0.99: give two betas"),
    ({"actor_muon_momentum": 1.0}, r"--actor_muon_momentum 1.0: must lie in \[0, 1\)"),
    ({"muon_ns_steps": 0}, r"--muon_ns_steps 0: must lie in \[1, 99\]"),
    ({"critic_l2": -0.1}, r"--critic_l2 -0.1: must be >= 0"),
    ({"actor_min_lr_ratio": 2.0}, r"--actor_min_lr_ratio 2.0: must lie in \[0, 1\]"),
])
def test_bad_optimiser_values_are_refused_before_anything_starts(flags, message):
    from rlhfkit.rl.validate import validate_rl

    with pytest.raises(ConfigError, match=message):
        validate_rl(ppo_cfg(**flags))


def test_the_offline_commands_check_the_shared_flags():
    from rlhfkit.cli.sft import GROUPS as SFT_GROUPS
    from rlhfkit.config.validate import validate_common

    for argv, message in ((["--muon_lr", "-1"], r"--muon_lr -1.0: must be >= 0"),
                          (["--adam_eps", "0"], r"--adam_eps 0.0: must be > 0"),
                          (["--max_norm", "-1"], r"--max_norm -1.0: must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            validate_common(parse_config("sft", SFT_GROUPS, argv))
