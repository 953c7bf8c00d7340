"""The parity flags parsed and checked: --advantage_estimator flash_reinforce, --is_correction_gating binary_kl|tv
(and Molt's dotted names), kto --vanilla_loss; bad values refused with errors naming the flags."""

import pytest

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError
from rlhfkit.rl.validate import validate_rl
from rlhfkit.trainers.kto import validate_kto


def _ppo(**flags):
    base = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "n_samples_per_prompt": 1,
            "rollout_batch_size": 8, "train_batch_size": 8}
    return parse_config("ppo", None, flags_to_argv({**base, **flags}))


def test_flash_reinforce_parses_in_both_dialects_needs_no_group_and_refuses_gamma():
    cfg = _ppo(advantage_estimator="flash_reinforce")
    validate_rl(cfg)  # one sample per prompt is its regime
    assert cfg.advantage_estimator == "flash_reinforce"
    dotted = parse_config("ppo", None, ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p",
                                        "--algo.advantage.estimator", "flash_reinforce"])
    assert dotted.advantage_estimator == "flash_reinforce"
    with pytest.raises(ConfigError, match="--gamma 0.9 with --advantage_estimator flash_reinforce"):
        validate_rl(_ppo(advantage_estimator="flash_reinforce", gamma=0.9))


def test_divergence_gate_parses_and_reaches_the_weights():
    on = {"enable_vllm_is_correction": True, "vllm_is_correction_type": "icepop",
          "vllm_is_truncated_threshold": [0, 0.005]}
    cfg = _ppo(is_correction_gating="binary_kl", **on)
    validate_rl(cfg)
    assert (cfg.is_correction_gating, cfg.vllm_is_truncated_threshold) == ("binary_kl", [0.0, 0.005])
    seq = _ppo(is_correction_gating="tv", is_correction_level="seq", is_correction_mode="mask",
               enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0, 0.1])
    validate_rl(seq)
    dotted = parse_config("ppo", None, ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p",
                                        "--algo.advantage.is_correction_gating", "tv"])
    assert dotted.is_correction_gating == "tv"
    assert _ppo().is_correction_gating == "ratio"


def test_divergence_gate_passes_the_config_to_the_policy_loss():
    import torch

    from rlhfkit.rl.policy_step import policy_loss

    cfg = _ppo(is_correction_gating="tv", enable_vllm_is_correction=True, vllm_is_correction_type="icepop",
               vllm_is_truncated_threshold=[0, 0.1])
    lp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.55, 0.9]], dtype=torch.float64))  # tv 0.05 (kept), 0.4 (dropped)
    mb = {"action_mask": torch.ones(1, 2, dtype=torch.bool), "advantages": torch.ones(1, 2, dtype=torch.float64),
          "rollout_log_probs": rollout}
    sums: dict = {}
    policy_loss(cfg, mb, lp.clone().requires_grad_(), torch.zeros(1, 2, dtype=torch.float64), lp, sums,
                num_tokens=2.0, num_seqs=1.0, kl_coef=0.0)
    assert "is_divergence_mean" in sums and "is_truncated_frac" in sums


@pytest.mark.parametrize(("flags", "message"), [
    ({"is_correction_gating": "tv"}, "--is_correction_gating tv .* add --enable_vllm_is_correction"),
    ({"is_correction_gating": "binary_kl", "enable_vllm_is_correction": True, "vllm_is_truncated_threshold": [0, 0.1]},
     "--is_correction_gating binary_kl .* token x clip"),
    ({"is_correction_gating": "tv", "enable_vllm_is_correction": True, "vllm_is_correction_type": "icepop"},
     "--vllm_is_truncated_threshold 0 DELTA"),
    ({"is_correction_gating": "tv", "enable_vllm_is_correction": True, "is_correction_level": "geo",
      "is_correction_mode": "mask", "vllm_is_truncated_threshold": [0, 0.1]}, "geo x mask"),
    ({"is_correction_gating": "tv", "enable_vllm_is_correction": True, "policy_loss_type": "gspo",
      "vllm_is_correction_type": "icepop", "vllm_is_truncated_threshold": [0, 0.1]}, "--policy_loss_type gspo"),
])
def test_divergence_gate_refusals_name_the_flags(flags, message):
    """Each bad use of --is_correction_gating is a ConfigError naming the flags involved."""
    with pytest.raises(ConfigError, match=message):
        validate_rl(_ppo(**flags))


def test_bad_gate_name_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _ppo(is_correction_gating="hellinger")
    assert "--is_correction_gating" in capsys.readouterr().err


def _kto(*extra):
    return parse_config("kto", None, ["--pretrain", "m", "--dataset", "d", *extra])


def test_vanilla_loss_parses_and_refuses_sample_weights():
    assert _kto().vanilla_loss is False
    cfg = _kto("--vanilla_loss")
    validate_kto(cfg)
    assert cfg.vanilla_loss is True
    with pytest.raises(ConfigError, match="--vanilla_loss with --desirable_loss_weight 2.0"):
        validate_kto(_kto("--vanilla_loss", "--desirable_loss_weight", "2.0"))
