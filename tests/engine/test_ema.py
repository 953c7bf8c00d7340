"""The actor's EMA (`rlhfkit.engine.ema`, ppo --enable_ema / --ema_beta) at the engine level: the average after real
optimizer steps against a float64 hand computation, the checkpoint round trip, the HF folder written from it, and
the flag checks. End to end (PPO, 1 and 2 ranks, resume): tests/rl/test_ppo.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.config.parse import parse_config
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.engine.ema import resolved_ema_beta
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.errors import ConfigError
from rlhfkit.rl.validate import validate_rl

CFG = SimpleNamespace(gradient_checkpointing=False, zero_stage=2, param_dtype="fp32", adam_offload=False,
                      aux_loss_coef=0.0, learning_rate=0.05, adam_betas=[0.9, 0.95], l2=0.0, lr_warmup_ratio=0.0,
                      lr_scheduler="constant", min_lr_ratio=0.0, max_norm=1.0, optim="adam", adam_eps=1e-8,
                      muon_lr=0.02, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True)
DIST = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def _engine(beta: float | None) -> TrainEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model[2].bias.requires_grad_(False)  # frozen: not averaged
    return TrainEngine(model, CFG, DIST, total_steps=10, ema_beta=beta)


def _step(engine: TrainEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(engine.model(x), y).backward()
    engine.optimizer_step()


def test_ema_after_real_steps_matches_a_float64_hand_computation():
    """The engine of a ppo --enable_ema actor: ema_T = beta^T theta_0 + (1 - beta) sum_t beta^(T-t) theta_t from the
    recorded parameter trajectory; frozen parameters are not averaged; without --enable_ema the engine keeps no EMA.
    The decay is the one the actor worker gives its engine, resolved from ppo's parsed flags."""
    beta = resolved_ema_beta(_ppo("--enable_ema", "--ema_beta", "0.7"))
    assert beta == 0.7
    engine = _engine(beta)
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    trajectory = [{n: p.detach().double().clone() for n, p in engine.model.named_parameters()}]
    for t in range(3):
        _step(engine, t)
        trajectory.append({n: p.detach().double().clone() for n, p in engine.model.named_parameters()})
    assert sorted(engine.ema.shadow) == sorted(names) and "2.bias" not in engine.ema.shadow
    T = len(trajectory) - 1
    for name in names:
        expected = beta ** T * trajectory[0][name] + sum(
            (1 - beta) * beta ** (T - t) * trajectory[t][name] for t in range(1, T + 1))
        got = engine.ema.shadow[name]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)
        # the check bites: the EMA is neither the start nor the current weights
        assert (got.double() - trajectory[-1][name]).abs().max() > 1e-3
        assert (got.double() - trajectory[0][name]).abs().max() > 1e-3
    assert engine.ema.updates == 3
    assert _engine(resolved_ema_beta(_ppo())).ema is None  # no --enable_ema


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_the_ema_is_part_of_the_resume_checkpoint(tmp_path):
    """Saved with the model and optimizer, restored in place; a checkpoint without one is refused for an EMA run."""
    engine = _engine(0.9)
    for t in range(2):
        _step(engine, t)
    saved = {n: v.clone() for n, v in engine.ema.shadow.items()}
    save_checkpoint(tmp_path / "a", 2, engine.model, engine.optimizer, engine.scheduler, {}, max_keep=1,
                    extra_state={"ema": engine.ema.state_dict()})
    fresh = _engine(0.9)
    assert any(not torch.equal(fresh.ema.shadow[n], saved[n]) for n in saved)
    load_checkpoint(tmp_path / "a", fresh.model, fresh.optimizer, fresh.scheduler,
                    extra_state={"ema": fresh.ema.state_dict()})
    for name, value in saved.items():
        assert torch.equal(fresh.ema.shadow[name], value), name
    _step(engine, 5), _step(fresh, 5)  # and both go on identically
    for name in saved:
        assert torch.equal(fresh.ema.shadow[name], engine.ema.shadow[name]), name
    plain = _engine(None)
    save_checkpoint(tmp_path / "b", 1, plain.model, plain.optimizer, plain.scheduler, {}, max_keep=1)
    with pytest.raises(ConfigError, match="holds no 'ema' state.*--enable_ema"):
        load_checkpoint(tmp_path / "b", fresh.model, fresh.optimizer, fresh.scheduler,
                        extra_state={"ema": fresh.ema.state_dict()})


def _ppo(*argv: str):
    base = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "builtin:math",
            "--advantage_estimator", "reinforce", "--rollout_batch_size", "4", "--train_batch_size", "4"]
    return parse_config("ppo", None, base + list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--enable_ema", "--ema_beta", "1.0"], r"--ema_beta 1.0 must be in \(0, 1\)"),
    (["--enable_ema", "--ema_beta", "0"], r"--ema_beta 0.0 must be in \(0, 1\)"),
    (["--enable_ema", "--ema_beta", "-0.5"], r"--ema_beta -0.5 must be in \(0, 1\)"),
    (["--ema_beta", "0.9"], "--ema_beta 0.9 without --enable_ema"),
])
def test_ema_beta_outside_the_interval_or_without_enable_ema_is_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate_rl(_ppo(*argv))
    validate_rl(_ppo("--enable_ema", "--ema_beta", "0.5"))  # accepted
    cfg = _ppo("--enable_ema")
    validate_rl(cfg)
    assert cfg.ema_beta is None  # the workers take OpenRLHF's default 0.992


def test_a_lora_actor_saves_the_average_of_its_adapters(tiny_model_dir, tokenizer, tmp_path):
    """With --lora_rank only the adapters train, so only they are averaged (ppo --enable_ema): the saved adapter
    file holds the EMA of lora_A / lora_B (here beta theta_0 + (1 - beta) theta_1), not the live adapters."""
    from safetensors.torch import load_file

    from rlhfkit.engine.checkpoint import save_hf_folder
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.lora import apply_lora

    torch.manual_seed(0)
    engine = TrainEngine(apply_lora(load_causal_lm(tiny_model_dir), 4), CFG, DIST, total_steps=10, ema_beta=0.5)
    assert engine.ema.shadow and all("lora_" in name for name in engine.ema.shadow)
    start = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    engine.model(input_ids=ids, labels=ids).loss.backward()
    engine.optimizer_step()
    save_hf_folder(engine.model, tokenizer, tmp_path / "hf", weights=engine.ema.full_state())
    saved = load_file(str(tmp_path / "hf" / "adapter_model.safetensors"))
    live = dict(engine.model.named_parameters())
    assert len(saved) == len(start)
    for key, value in saved.items():
        name = key.replace(".weight", ".default.weight")  # peft's file drops the adapter name
        expected = 0.5 * start[name].double() + 0.5 * live[name].detach().double()
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-8)
    assert any(not torch.equal(saved[k], live[k.replace(".weight", ".default.weight")].detach()) for k in saved)


def test_the_worker_takes_the_resolved_decay():
    """--enable_ema alone decays with OpenRLHF's 0.992, --ema_beta overrides it, no EMA without --enable_ema."""
    from types import SimpleNamespace

    from rlhfkit.engine.ema import resolved_ema_beta

    assert resolved_ema_beta(SimpleNamespace(enable_ema=True, ema_beta=None)) == 0.992
    assert resolved_ema_beta(SimpleNamespace(enable_ema=True, ema_beta=0.5)) == 0.5
    assert resolved_ema_beta(SimpleNamespace(enable_ema=False, ema_beta=None)) is None
