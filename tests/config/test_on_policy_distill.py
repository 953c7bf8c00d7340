"""On-policy distillation's flags (#31): the teacher sits in the reference role, the reference-KL flags and a second
teacher are refused, its flags are refused on other estimators, both flag dialects name the estimator, and a teacher
whose tokenizer differs from the student's stops the run with both models named."""

from __future__ import annotations

import pytest

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.config.plan import reference_model, resolve_plan
from rlhfkit.errors import ConfigError
from rlhfkit.models.vocabulary import check_same_tokenizer
from rlhfkit.rl.make_experience import old_log_probs_from_training_pass
from rlhfkit.rl.validate import validate_rl

BASE = {"pretrain": "student", "prompt_data": "p", "remote_rm_url": "builtin:format"}
OPD = {**BASE, "advantage_estimator": "on_policy_distill", "teacher_model": "teacher"}


def cfg(**flags):
    return parse_config("ppo", None, flags_to_argv(flags))


def test_the_teacher_is_the_reference_role_and_no_reference_kl_is_kept():
    c = cfg(**OPD)
    validate_rl(c)
    p = resolve_plan(c)
    assert p.distill and p.needs_ref and p.kl_mode == "off" and not p.needs_critic
    assert reference_model(c) == "teacher"
    assert reference_model(cfg(**{**OPD, "teacher_model": None, "ref_pretrain": "molt_teacher"})) == "molt_teacher"
    assert reference_model(cfg(**BASE, ref_pretrain="r")) == "r" and reference_model(cfg(**BASE)) == "student"
    # its advantages are made of the student's old log-probs: the separate pass is never skipped
    assert not old_log_probs_from_training_pass(c, p, 8, True)
    flat = cfg(**BASE, init_kl_coef=0)
    assert old_log_probs_from_training_pass(flat, resolve_plan(flat), 8, False)


def test_dotted_and_flat_dialects_give_the_same_estimator():
    dotted = parse_config("ppo", None, ["--actor.model_name_or_path", "student", "--data.prompt_dataset", "p",
                                        "--reward.remote_url", "builtin:format", "--algo.advantage.estimator",
                                        "on_policy_distill", "--ref.model_name_or_path", "teacher"])
    assert dotted.advantage_estimator == "on_policy_distill" and reference_model(dotted) == "teacher"
    validate_rl(dotted)


@pytest.mark.parametrize(("flags", "message"), [
    ({"teacher_model": None}, r"on_policy_distill needs a teacher: --teacher_model PATH \(or --ref_pretrain"),
    ({"ref_pretrain": "r"}, r"--teacher_model teacher and --ref_pretrain r: .* give it once"),
    ({"use_kl_loss": True}, r"--use_kl_loss with --advantage_estimator on_policy_distill: .* drop --use_kl_loss"),
    ({"kl_target": 0.1}, r"--kl_target 0.1 with .* drop --kl_target"),
    ({"gamma": 0.9}, r"--gamma 0.9 with --advantage_estimator on_policy_distill: .*\(discount 0"),
    ({"opd_kl_coef": 0.0}, r"--opd_kl_coef 0.0: .* must be > 0"),
    ({"opd_reward_weight": -1.0}, r"--opd_reward_weight -1.0: must be >= 0"),
])
def test_contradictions_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate_rl(cfg(**{**OPD, **flags}))


def test_the_distillation_flags_need_the_estimator():
    with pytest.raises(ConfigError, match=r"--teacher_model t, --opd_reward_weight 0.5: on-policy distillation flags, "
                                          r"but --advantage_estimator is group_norm"):
        validate_rl(cfg(**BASE, advantage_estimator="group_norm", n_samples_per_prompt=2, teacher_model="t",
                        opd_reward_weight=0.5))
    with pytest.raises(ConfigError, match=r"--opd_kl_coef 2.0: on-policy distillation flags"):
        validate_rl(cfg(**BASE, opd_kl_coef=2.0))
    with pytest.raises(ConfigError, match=r"--opd_kl_coef -1.0: the weight of the reverse-KL term must be > 0"):
        validate_rl(cfg(**OPD, opd_kl_coef=-1.0))


@pytest.fixture(scope="module")
def other_tokenizer_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with two tokens added to its tokenizer (and embedding rows for them): another vocabulary."""
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer

    tok, model = load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)
    tok.add_tokens(["<teacher_only_a>", "<teacher_only_b>"])
    model.resize_token_embeddings(len(tok))
    out = tmp_path_factory.mktemp("other_tokenizer")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model_dir, other_tokenizer_model):
    check_same_tokenizer(tiny_model_dir, tiny_model_dir)  # the same tokenizer passes
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(tiny_model_dir, other_tokenizer_model)
    text = str(err.value)
    assert f"--pretrain {tiny_model_dir} and --teacher_model {other_tokenizer_model} have different tokenizers" in text
    assert "2 tokens differ, e.g. '<teacher_only_a>'" in text


def test_the_run_stops_at_start_on_another_tokenizer(tiny_model_dir, other_tokenizer_model, tmp_path):
    """build_setup checks before Ray or any model starts."""
    from rlhfkit.rl.setup import build_setup

    c = cfg(**{**OPD, "pretrain": tiny_model_dir, "teacher_model": None, "ref_pretrain": other_tokenizer_model,
               "run_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match=f"--ref_pretrain {other_tokenizer_model} have different tokenizers"):
        build_setup(c)
