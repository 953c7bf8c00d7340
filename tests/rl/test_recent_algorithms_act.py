"""The recent algorithm options act in a real tiny `rlhfkit ppo` run (same pattern as test_algorithm_options_act.py):
--policy_loss_type gspo and cispo, --is_correction_level / --is_correction_mode, --vllm_is_correction_type
seq-mask-tis, --kl_target / --kl_horizon, --use_unbiased_kl, --overlong_buffer_len / --overlong_penalty_factor and
--stop_properly_penalty_coef. The tensors `--debug_dump_steps` writes are checked against float64 references
written from the formulas of docs/algorithms.md (not by calling rlhfkit.algorithms); --gamma with a group estimator
is refused."""

from __future__ import annotations

import pytest
import torch
from ppo_helpers import run, series
from test_algorithm_options_act import ONE_STEP, close, differs, f64, group_ref, kl_ref, load_dump, micro_batches

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError
from rlhfkit.rl.validate import validate_rl


def gspo_ref(log_probs, old, adv, mask, low, high) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss -min(s_i A, clip(s_i, 1 - low, 1 + high) A), s_i = exp(mean_t (log pi - log pi_old)); s_i."""
    m = mask.bool()
    lr = torch.where(m, f64(log_probs) - f64(old), torch.zeros((), dtype=torch.float64))
    s = torch.exp(lr.sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1).expand(m.shape)
    a = f64(adv)
    return -torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a), s


@pytest.mark.slow
def test_gspo_sequence_ratio_and_loss(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    """--policy_loss_type gspo with --eps_clip 0.05: the logged ratio is one number per sequence, the per-token
    loss is the sequence-clipped surrogate, and the loss backward got is its per-sequence mean over the mini-batch."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **ONE_STEP, advantage_estimator="group_norm",
        policy_loss_type="gspo", eps_clip=0.05)
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    mask = exp["action_mask"]
    adv = group_ref("group_norm", f64(exp["rewards"]).tolist(), 8)
    close(exp["advantages"], torch.tensor(adv).unsqueeze(1).expand(mask.shape), mask, atol=1e-5)
    clipped_rows = off_one = 0
    for _, mb in micro_batches(dump):
        m = mb["action_mask"].bool()
        want, s = gspo_ref(mb["log_probs"], mb["old_log_probs"], mb["advantages"], m, 0.05, 0.05)
        close(mb["ratio"], s, m)
        close(mb["policy_loss"], want, m)
        per_seq = (want * m).sum(-1) / m.sum(-1)
        assert float(mb["loss"]) == pytest.approx(float(per_seq.sum() / ONE_STEP["train_batch_size"]), rel=1e-5,
                                                  abs=1e-7)
        rows_s = s[:, 0]
        clipped_rows += int(((rows_s < 0.95) | (rows_s > 1.05)).sum())
        tok = torch.exp(f64(mb["log_probs"]) - f64(mb["old_log_probs"]))
        off_one += int(differs(tok, s, m, by=1e-4))  # the per-token (ppo) ratio is not the sequence ratio
    assert clipped_rows > 0 and off_one > 0, (clipped_rows, off_one)


@pytest.mark.slow
def test_cispo_with_a_sequence_level_truncated_is_correction(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                             tmp_path):
    """--policy_loss_type cispo --eps_clip 0.05 with --enable_vllm_is_correction --is_correction_level seq
    --is_correction_mode trunc --vllm_is_truncated_threshold 0.5 1.0: the IS weight of every token is
    min(prod_t exp(old - rollout), 1) of its row, the per-token loss is -w clip(rho, 0.95, 1.05) A log pi, the loss
    backward got is its token mean, and it is not PPO's loss on the same tensors (the default loss differs)."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **ONE_STEP, advantage_estimator="group_norm",
        policy_loss_type="cispo", eps_clip=0.05, enable_vllm_is_correction=True, is_correction_level="seq",
        is_correction_mode="trunc", vllm_is_truncated_threshold=[0.5, 1.0])
    dump = load_dump(tmp_path)
    capped = below = clipped = ppo_differs = 0
    for entry, mb in micro_batches(dump):
        m = mb["action_mask"].bool()
        zero = torch.zeros((), dtype=torch.float64)
        lw = torch.where(m, f64(mb["old_log_probs"]) - f64(mb["rollout_log_probs"]), zero)
        u = torch.exp(lw.sum(-1)).unsqueeze(-1).expand(m.shape)
        w = u.clamp(max=1.0)
        close(mb["is_weights"], w, m, atol=1e-6)
        capped += int((u[:, 0] > 1.0).sum())
        below += int((u[:, 0] < 1.0 - 1e-6).sum())
        lp, adv = f64(mb["log_probs"]), f64(mb["advantages"])
        rho = torch.exp(lp - f64(mb["old_log_probs"]))
        want = -w * rho.clamp(0.95, 1.05) * adv * torch.where(m, lp, zero)
        close(mb["policy_loss"], want, m, atol=1e-5)
        assert float(mb["loss"]) == pytest.approx(float((want * m).sum() / entry["num_tokens"]), rel=1e-5, abs=1e-7)
        clipped += int((((rho < 0.95) | (rho > 1.05)) & m).sum())
        ppo = -w * torch.minimum(rho * adv, rho.clamp(0.95, 1.05) * adv)
        ppo_differs += int(differs(ppo, want, m, by=1e-3))
    assert capped > 0 and below > 0 and clipped > 0 and ppo_differs > 0, (capped, below, clipped, ppo_differs)


@pytest.mark.slow
def test_length_penalties_seq_mask_tis_adaptive_and_unbiased_kl(tiny_model_dir, echo_prompt_file,
                                                               rollout_vllm_engine, tmp_path):
    """Two steps of rloo with --overlong_buffer_len 6 --overlong_penalty_factor 0.5 --stop_properly_penalty_coef
    0.5, --vllm_is_correction_type seq-mask-tis, --kl_target 0.1 --kl_horizon 64 and --use_kl_loss
    --use_unbiased_kl (k3, the reference is the initial policy)."""
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **{**ONE_STEP, "max_samples": 8},
               advantage_estimator="rloo", overlong_buffer_len=6, overlong_penalty_factor=0.5,
               stop_properly_penalty_coef=0.5, enable_vllm_is_correction=True,
               vllm_is_correction_type="seq-mask-tis", vllm_is_truncated_threshold=[1.0, 5.0], use_kl_loss=True,
               use_unbiased_kl=True, kl_estimator="k3", init_kl_coef=0.05, kl_target=0.1, kl_horizon=64)
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    mask = exp["action_mask"]

    # Length penalties: r' = r - min(max(|y| - (8 - 6), 0), 6) / 6 x 0.5, then x 0.5 for finish reason 'length'.
    lengths = mask.sum(-1).double()
    raw, truncated = f64(exp["rewards_before_penalty"]), exp["truncated"].bool()
    want = raw - (lengths - 2).clamp(0, 6) / 6 * 0.5
    want = torch.where(truncated, want * 0.5, want)
    torch.testing.assert_close(f64(exp["rewards"]), want, atol=1e-6, rtol=1e-6)
    assert bool(truncated.any()) and bool((lengths > 2).any())
    assert rows[0]["rollout/overlong_penalty_mean"] == pytest.approx(float(-(lengths - 2).clamp(0, 6).mean() / 12))
    adv = torch.tensor(group_ref("rloo", f64(exp["rewards"]).tolist(), 8)).unsqueeze(1).expand(mask.shape)
    close(exp["advantages"], adv, mask, atol=1e-6)  # the advantages are built from the penalised rewards

    # seq-mask-tis: w_t = clamp(exp(old - rollout), 1.0, 5.0), kept where the row's geometric mean is in [1.0, 5.0],
    # else 0 (the clamp of a kept row's token weights is OpenRLHF #1298).
    kept = dropped = icepop_differs = 0
    for entry, mb in micro_batches(dump):
        m = mb["action_mask"].bool()
        lw = torch.where(m, f64(mb["old_log_probs"]) - f64(mb["rollout_log_probs"]), torch.zeros(()).double())
        seq = torch.exp(lw.sum(-1) / m.sum(-1)).unsqueeze(-1)
        w = torch.where((seq >= 1.0) & (seq <= 5.0), lw.exp().clamp(1.0, 5.0), torch.zeros_like(lw))
        close(mb["is_weights"], w, m, atol=1e-6)
        kept += int(((seq[:, 0] >= 1.0)).sum())
        dropped += int(((seq[:, 0] < 1.0)).sum())
        icepop_differs += int((((w > 0) & (lw.exp() < 1.0)) & m).sum())  # token-level icepop would drop these

        # --use_unbiased_kl: the loss backward got = token-mean policy loss + beta x token-mean rho_t k3(r_t).
        tokens = entry["num_tokens"]
        rho = torch.exp(f64(mb["log_probs"]) - f64(mb["old_log_probs"]))
        k3 = kl_ref(mb["log_probs"], mb["ref_log_probs"], "k3")
        close(mb["kl"], k3, m, atol=1e-5)
        policy = (f64(mb["policy_loss"]) * m).sum() / tokens
        assert float(mb["loss"]) == pytest.approx(float(policy + 0.05 * (rho * k3 * m).sum() / tokens), rel=1e-5,
                                                  abs=1e-8)
    assert kept > 0 and dropped > 0 and icepop_differs > 0, (kept, dropped, icepop_differs)
    second = dump["actor"][-1]["micro_batches"]
    assert any(differs(torch.exp(f64(mb["log_probs"]) - f64(mb["old_log_probs"])), torch.ones_like(f64(mb["kl"])),
                       mb["action_mask"], by=1e-4) and float((f64(mb["kl"]) * mb["action_mask"]).abs().sum()) > 0
               for mb in second)  # rho is not 1 and the KL is not 0 on the second update: the weight acts

    # --kl_target 0.1 --kl_horizon 64: beta_2 = beta_1 (1 + clip(KL_1 / 0.1 - 1, +-0.2) x 32 / 64).
    coef = series(rows, "train/kl_coef")
    kl = series(rows, "rollout/kl")
    assert len(coef) == 2 and coef[0] == pytest.approx(0.05)
    assert coef[1] == pytest.approx(0.05 * (1 + min(max(kl[0] / 0.1 - 1, -0.2), 0.2) * 32 / 64), rel=1e-9)
    assert coef[1] != pytest.approx(0.05)


def _cfg(**flags):
    base = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "n_samples_per_prompt": 4,
            "rollout_batch_size": 8, "train_batch_size": 8}
    return parse_config("ppo", None, flags_to_argv({**base, **flags}))


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "reinforce_baseline", "dr_grpo"])
def test_gamma_is_refused_for_group_estimators(estimator):
    """--gamma must stay 1 with a group baseline (OpenRLHF forces it); gae and reinforce take it."""
    with pytest.raises(ConfigError, match=rf"--gamma 0.9 with --advantage_estimator {estimator}"):
        validate_rl(_cfg(advantage_estimator=estimator, gamma=0.9))
    validate_rl(_cfg(advantage_estimator=estimator, gamma=1.0))
    validate_rl(_cfg(advantage_estimator="reinforce", gamma=0.9))


def test_refused_values_of_the_recent_flags():
    """--kl_target needs --init_kl_coef > 0 and a positive --kl_horizon; --use_unbiased_kl needs --use_kl_loss;
    --overlong_buffer_len must fit in --generate_max_len; --stop_properly_penalty_coef is <= 1; --reward_clip_range
    is two numbers (low high)."""
    cases = [({"kl_target": 0.1, "init_kl_coef": 0.0}, "--kl_target"),
             ({"kl_target": 0.1, "kl_horizon": 0}, "--kl_horizon"),
             ({"use_unbiased_kl": True}, "--use_unbiased_kl"),
             ({"use_unbiased_kl": True, "use_kl_loss": True, "kl_estimator": "k2"}, "--kl_estimator k2: the "),
             ({"overlong_buffer_len": 9, "generate_max_len": 8}, "--overlong_buffer_len"),
             ({"stop_properly_penalty_coef": 1.5}, "--stop_properly_penalty_coef"),
             ({"reward_clip_range": [1.0, 2.0, 3.0]}, "--reward_clip_range 1.0 2.0 3.0: give two numbers")]
    for flags, name in cases:
        with pytest.raises(ConfigError, match=name):
            validate_rl(_cfg(**flags))
    validate_rl(_cfg(kl_target=0.1, kl_horizon=100, overlong_buffer_len=8, generate_max_len=8,
                     stop_properly_penalty_coef=-0.5, use_kl_loss=True, use_unbiased_kl=True, kl_estimator="k3"))
    assert _cfg().policy_loss_type == "ppo" and _cfg().kl_target is None and _cfg().kl_horizon == 10000
    assert _cfg(vllm_is_correction_type="seq-mask-tis").vllm_is_correction_type == "seq-mask-tis"


def test_the_adaptive_kl_coefficient_is_checkpointed_and_resumed(monkeypatch):
    """--kl_target: the controller's beta goes into the trainer state of a checkpoint and comes back on resume."""
    from types import SimpleNamespace

    import rlhfkit.rl.setup as setup_module
    from rlhfkit.config.plan import resolve_plan
    from rlhfkit.rl.setup import RLSetup, _resume, kl_controller

    cfg = _cfg(kl_target=0.1, kl_horizon=64, init_kl_coef=0.05, ckpt_path="/nowhere", max_ckpt_num=1,
               save_hf_ckpt=False)
    saved = {}

    class Actor:
        def call(self, method, path, *args):
            if method.__name__ == "save_checkpoint":  # a ModelWorker method, as ModelGroup.call takes it
                saved.update(args[1], step=args[0])
                return None
            return [dict(saved)]

    ctl = kl_controller(cfg)
    assert type(ctl).__name__ == "AdaptiveKLController" and ctl.value == 0.05
    ctl.update(0.0, 32)
    plan = resolve_plan(cfg)
    s = SimpleNamespace(cfg=cfg, plan=plan, ptx=None, actor=Actor(), critic=None, kl_ctl=ctl, engines=[])
    RLSetup.save_checkpoint(s, 3, 10)
    assert saved["kl_ctl"] == {"value": pytest.approx(0.05 * (1 - 0.2 * 32 / 64))}
    monkeypatch.setattr(setup_module, "push_actor_weights", lambda *a: None)
    fresh = SimpleNamespace(cfg=cfg, plan=plan, ptx=None, actor=Actor(), critic=None, kl_ctl=kl_controller(cfg),
                            engines=[])
    _resume(fresh)
    assert fresh.start_step == 3 and fresh.kl_ctl.value == ctl.value
    assert type(kl_controller(_cfg())).__name__ == "FixedKLController"


def test_grid_and_cispo_flags_are_checked():
    """--is_correction_level and --is_correction_mode come together, need --enable_vllm_is_correction, not with gspo
    or beside another named --vllm_is_correction_type; cispo refuses --dual_clip; Molt's dotted names reach them."""
    on = {"enable_vllm_is_correction": True}
    cases = [({"is_correction_level": "seq", **on}, "--is_correction_level without --is_correction_mode"),
             ({"is_correction_mode": "clip", **on}, "--is_correction_mode without --is_correction_level"),
             ({"is_correction_level": "geo", "is_correction_mode": "trunc"}, "add --enable_vllm_is_correction"),
             ({"is_correction_level": "geo", "is_correction_mode": "mask", "policy_loss_type": "gspo", **on},
              "--policy_loss_type gspo"),
             ({"is_correction_level": "token", "is_correction_mode": "mask", "vllm_is_correction_type": "icepop",
               **on}, "--vllm_is_correction_type icepop and --is_correction_level token"),
             ({"policy_loss_type": "cispo", "dual_clip": 3.0}, "--dual_clip 3.0")]
    for flags, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate_rl(_cfg(**flags))
    cfg = _cfg(is_correction_level="seq", is_correction_mode="trunc", policy_loss_type="cispo", **on)
    validate_rl(cfg)
    assert (cfg.is_correction_level, cfg.is_correction_mode, cfg.policy_loss_type) == ("seq", "trunc", "cispo")
    dotted = parse_config("ppo", None, ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p",
                                        "--algo.advantage.is_correction_level", "geo",
                                        "--algo.advantage.is_correction_mode", "clip"])
    assert (dotted.is_correction_level, dotted.is_correction_mode) == ("geo", "clip")
    assert _cfg().is_correction_level is None and _cfg().is_correction_mode is None
