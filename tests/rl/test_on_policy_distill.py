"""`rlhfkit ppo --advantage_estimator on_policy_distill` end to end on tiny models (#31): a random tiny student
samples; a teacher that differs from it (the same weights with the final norm scaled by 4: logits x 4, sharper
than the near-uniform student) scores every sampled token; the student's held-out reverse KL to the teacher
falls. The same run works with --async_train and with --colocate_all_models."""

from __future__ import annotations

import pytest
import torch
from ppo_helpers import run, series

from rlhfkit.data.synthetic import echo_rows

pytestmark = pytest.mark.slow

OPD = {"n_samples_per_prompt": 8, "rollout_batch_size": 4,
       "train_batch_size": 32, "micro_train_batch_size": 16, "micro_rollout_batch_size": 16, "generate_max_len": 8,
       "actor_learning_rate": 5e-3}


@pytest.fixture(scope="module")
def sharp_teacher(tmp_path_factory) -> str:
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.models.tiny import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("opd_teacher")
    base = build_tiny_causal_lm(str(root / "base"), seed=0)  # the student's weights (tiny_model_dir: seed 0)
    model = load_causal_lm(base)
    with torch.no_grad():  # a sharper copy: logits x 4 (the final norm feeds only the tied lm_head)
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(root / "teacher")
    load_tokenizer(base).save_pretrained(root / "teacher")
    return str(root / "teacher")


def heldout_kl(student_dir: str, teacher_dir: str) -> float:
    from rlhfkit.inference.distill_eval import heldout_reverse_kl
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(student_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["input"]}], add_generation_prompt=True)
               for r in echo_rows(8, seed=11)]
    ids = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    return heldout_reverse_kl(load_causal_lm(student_dir).eval(), load_causal_lm(teacher_dir).eval(), tok, ids,
                              max_new_tokens=8, seed=0).reverse_kl


def test_the_student_moves_toward_the_teacher(tiny_model_dir, echo_prompt_file, sharp_teacher, rollout_vllm_engine,
                                              tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, teacher_model=sharp_teacher,
               advantage_estimator="on_policy_distill", max_samples=48, **OPD)
    assert len(rows) == 12
    kl = series(rows, "rollout/opd_reverse_kl")
    assert len(kl) == 12 and all(v > 0 for v in kl[:2])
    print(f"\nrollout reverse KL per step: {[round(v, 3) for v in kl]}")
    assert sum(kl[-4:]) < 0.8 * sum(kl[:4]), kl  # the sampled reverse KL of the rollouts falls
    before, after = heldout_kl(tiny_model_dir, sharp_teacher), heldout_kl(str(tmp_path / "hf"), sharp_teacher)
    print(f"\nheld-out reverse KL to the teacher: {before:.3f} -> {after:.3f} nats/token")
    assert after < 0.7 * before, (before, after)
    assert "rollout/kl" not in rows[0]  # no KL to a reference: the reference role is the teacher


@pytest.mark.parametrize("mode", [{"async_train": True, "enable_vllm_is_correction": True},
                                  {"colocate_all_models": True}], ids=["async_train", "colocate_all_models"])
def test_it_runs_async_and_colocated(tiny_model_dir, echo_prompt_file, sharp_teacher, rollout_vllm_engine, tmp_path,
                                     mode):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, teacher_model=sharp_teacher,
               advantage_estimator="on_policy_distill", max_samples=12, opd_reward_weight=0.5, **OPD, **mode)
    assert len(rows) == 3
    kl = series(rows, "rollout/opd_reverse_kl")
    assert len(kl) == 3 and kl[-1] < kl[0], kl
    assert all(r["train/grad_norm"] > 0 for r in rows)
