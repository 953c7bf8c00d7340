"""`rlhfkit ppo` with --top_p / --top_k on the real vLLM engine (fp32 tiny model): with --logprobs_truncation auto
(the default) the trainer's log-probs are the engine's (rollout/logprob_abs_diff_mean ~1e-7, every importance ratio
1), with off they carry the truncation's log Z bias; the reference model is truncated the same way (the KL at the
first step is 0) and the weight-sync check (whole-softmax probe on both sides) passes."""

from __future__ import annotations

import pytest
from ppo_helpers import run

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.models.logprobs import SamplingTruncation
from rlhfkit.rl.worker import logprob_truncation

pytestmark = pytest.mark.slow


def _cfg(*argv: str):
    return parse_config("ppo", None, flags_to_argv({"pretrain": "m", "prompt_data": "p"}) + list(argv))


def test_the_flags_choose_the_trainers_truncation():
    assert logprob_truncation(_cfg()) is None  # nothing cut
    assert logprob_truncation(_cfg("--top_p", "0.9")) == SamplingTruncation(top_p=0.9)
    assert logprob_truncation(_cfg("--top_k", "20", "--top_p", "0.9")) == SamplingTruncation(top_k=20, top_p=0.9)
    assert logprob_truncation(_cfg("--top_k", "20", "--logprobs_truncation", "off")) is None


def test_top_p_ratios_are_exact_with_the_fix_and_biased_without(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                               tmp_path):
    flags = {"max_samples": 4, "top_p": 0.9, "enable_vllm_is_correction": True}
    fixed = run(tiny_model_dir, echo_prompt_file, tmp_path / "auto", rollout_vllm_engine, **flags)
    biased = run(tiny_model_dir, echo_prompt_file, tmp_path / "off", rollout_vllm_engine, logprobs_truncation="off",
                 **flags)
    (a,), (b,) = fixed, biased
    print(f"top_p 0.9 logprob_abs_diff_mean: auto {a['rollout/logprob_abs_diff_mean']:.3g} "
          f"off {b['rollout/logprob_abs_diff_mean']:.3g}; max: auto {a['rollout/logprob_abs_diff_max']:.3g} "
          f"off {b['rollout/logprob_abs_diff_max']:.3g}")
    assert a["rollout/logprob_abs_diff_mean"] < 1e-5 and a["rollout/logprob_abs_diff_max"] < 1e-4
    assert a["rollout/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # near-uniform random-init model: the 0.9 nucleus holds ~90% of the mass, log(1 / 0.9) = 0.105 per token
    assert b["rollout/logprob_abs_diff_mean"] > 0.05
    assert abs(b["rollout/is_ratio_mean"] - 1.0) > 0.05
    assert a["sync/logprob_diff"] < 1e-3 and b["sync/logprob_diff"] < 1e-3  # the probe is untruncated on both sides


def test_top_k_and_top_p_packed_with_a_reference(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    """Both cuts, the packed forward, and a k1 KL loss to the reference: the reference's log-probs use the same
    truncation, so the KL of the starting policy to itself is 0 (whole-softmax reference: log Z_N > 0 per token)."""
    flags = {"max_samples": 4, "top_k": 20, "top_p": 0.9, "packing_samples": True, "init_kl_coef": 0.1,
             "use_kl_loss": True, "kl_estimator": "k1", "recompute_old_log_probs": True}
    fixed = run(tiny_model_dir, echo_prompt_file, tmp_path / "auto", rollout_vllm_engine, **flags)
    biased = run(tiny_model_dir, echo_prompt_file, tmp_path / "off", rollout_vllm_engine, logprobs_truncation="off",
                 **flags)
    (a,), (b,) = fixed, biased
    print(f"top_k 20 top_p 0.9 logprob_abs_diff_mean: auto {a['rollout/logprob_abs_diff_mean']:.3g} "
          f"off {b['rollout/logprob_abs_diff_mean']:.3g}")
    assert a["rollout/logprob_abs_diff_mean"] < 1e-5
    assert b["rollout/logprob_abs_diff_mean"] > 1.0  # top-20 of a near-uniform 49k vocabulary: log(49152 / 20)
    assert a["rollout/kl"] == pytest.approx(0.0, abs=1e-6) and b["rollout/kl"] == pytest.approx(0.0, abs=1e-6)
