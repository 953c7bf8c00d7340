"""`rlhfkit ppo --advantage_estimator on_policy_distill` end to end on tiny models (#31).

The student and the teacher are the tiny random model after a few SFT steps on the echo task ("Repeat: red cat" ->
"red cat"): the student after 10 steps, the teacher after 4 more. Both are therefore concentrated on a few hundred
tokens (the student's own samples cover the mass the teacher's log-ratio speaks about), and the teacher differs from
the student by a few Adam steps, which the student can retrace. A random-init student, near uniform over the
49152-token vocabulary, cannot learn from a teacher: 256 sampled tokens a step make a gradient whose cosine with the
exact reverse-KL gradient is ~0 (measured: -0.003; 0.85 for the SFT'd pair), so Adam only random-walks it away.

One float64 check of a whole step (the teacher's and the student's log-probs recomputed with transformers, the
per-token advantages, the per-token loss and its token-mean aggregation), the held-out reverse KL falling over 12
steps, and the same run with --async_train and with --colocate_all_models."""

from __future__ import annotations

import pytest
import torch
from ppo_helpers import run, series
from test_algorithm_options_act import close, f64, hf_log_probs_and_entropy, load_dump, micro_batches, ppo_loss_ref

from rlhfkit.data.synthetic import echo_rows

pytestmark = pytest.mark.slow

OPD = {"n_samples_per_prompt": 8, "rollout_batch_size": 4, "train_batch_size": 32, "micro_train_batch_size": 16,
       "micro_rollout_batch_size": 16, "generate_max_len": 8, "actor_learning_rate": 1e-2}
SFT_LR = 1e-2
STUDENT_SFT_STEPS, TEACHER_EXTRA_STEPS = 10, 4


def sft_steps(model, tokenizer, rows: list[dict], steps: int) -> None:
    """`steps` AdamW steps (lr SFT_LR, betas 0.9/0.95, no decay) of token-mean NLL of the echo answers + eos, 16 rows
    a step, the rows taken in order."""
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for step in range(steps):
        opt.zero_grad()
        for r in rows[16 * step: 16 * (step + 1)]:
            prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": r["input"]}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
            answer = tokenizer(r["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float()
            nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None]).sum()
            (nll / (16 * len(answer))).backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def student_and_teacher(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer

    root = tmp_path_factory.mktemp("opd_pair")
    tok = load_tokenizer(tiny_model_dir)
    rows = echo_rows(16 * (STUDENT_SFT_STEPS + TEACHER_EXTRA_STEPS), seed=1)  # not the prompts of the runs
    model = load_causal_lm(tiny_model_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        sft_steps(model, tok, rows, STUDENT_SFT_STEPS)
        model.save_pretrained(root / "student")
        tok.save_pretrained(root / "student")
        sft_steps(model, tok, rows[16 * STUDENT_SFT_STEPS:], TEACHER_EXTRA_STEPS)
        model.save_pretrained(root / "teacher")
        tok.save_pretrained(root / "teacher")
    return str(root / "student"), str(root / "teacher")


def heldout_kl(student_dir: str, teacher_dir: str) -> float:
    from rlhfkit.inference.distill_eval import heldout_reverse_kl
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(student_dir)
    ids = [list(tok.apply_chat_template([{"role": "user", "content": r["input"]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]) for r in echo_rows(16, seed=11)]
    return heldout_reverse_kl(load_causal_lm(student_dir).eval(), load_causal_lm(teacher_dir).eval(), tok, ids,
                              max_new_tokens=8, seed=0).reverse_kl


def test_one_step_against_a_float64_reference(student_and_teacher, echo_prompt_file, rollout_vllm_engine, tmp_path):
    """--opd_kl_coef 0.5 --opd_reward_weight 0.5, one step of 32 rows in two mini-batches: the teacher's and the
    student's log-probs are those transformers computes; each token's advantage is
    0.5 (log pi_teacher - log pi_student) + 0.5 (r - mean_group r), different token by token (not a sequence value,
    not whitened); each token's loss is -min(rho A, clip(rho) A) and the micro-batch loss their sum over the
    mini-batch's token count; rollout/opd_reverse_kl is the token mean of log pi_student - log pi_teacher."""
    student, teacher = student_and_teacher
    rows = run(student, echo_prompt_file, tmp_path, rollout_vllm_engine, teacher_model=teacher,
               advantage_estimator="on_policy_distill", opd_kl_coef=0.5, opd_reward_weight=0.5, max_samples=4,
               debug_dump_steps=["1"], **{**OPD, "train_batch_size": 16, "micro_train_batch_size": 8})
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    seq, attn, mask = exp["sequences"], exp["attention_mask"], exp["action_mask"]
    width = mask.shape[1]
    t_lp, _ = hf_log_probs_and_entropy(teacher, seq, attn, width)
    s_lp, _ = hf_log_probs_and_entropy(student, seq, attn, width)
    close(exp["ref_log_probs"], t_lp, mask, atol=1e-4)
    close(exp["old_log_probs"], s_lp, mask, atol=1e-4)
    r = f64(exp["rewards"]).clamp(-10, 10)
    task = r - r.view(-1, 8).mean(1, keepdim=True).expand(-1, 8).reshape(-1)
    want = 0.5 * (t_lp - s_lp) + 0.5 * task[:, None]
    close(exp["advantages"], want, mask, atol=1e-4)
    assert float(task.abs().max()) > 0  # the reward term is not zero here, so its weight is checked
    adv = f64(exp["advantages"])
    spread = [float(adv[i][mask[i]].std()) for i in range(adv.shape[0]) if int(mask[i].sum()) > 1]
    assert min(spread) > 1e-3  # per token, not one value per sequence
    assert float(adv[mask].mean()) < -0.05  # not whitened: the mean is -0.5 x the sampled reverse KL
    sampled_kl = float((f64(exp["old_log_probs"]) - f64(exp["ref_log_probs"]))[mask].mean())
    assert rows[0]["rollout/opd_reverse_kl"] == pytest.approx(sampled_kl, rel=1e-4)
    for entry, mb in micro_batches(dump):
        m = mb["action_mask"]
        close(mb["advantages"], exp["advantages"][mb["row_index"], :m.shape[1]], m, atol=1e-6)
        close(mb["policy_loss"], ppo_loss_ref(mb["log_probs"], mb["old_log_probs"], mb["advantages"], 0.2, 0.2), m)
        want_loss = (f64(mb["policy_loss"]) * m).sum() / entry["num_tokens"]
        assert float(mb["loss"]) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)
    first = dump["actor"][0]["micro_batches"][0]  # the first update: ratio 1, so the loss is -A per token
    close(first["policy_loss"], -f64(first["advantages"]), first["action_mask"], atol=1e-5)


def test_the_student_moves_toward_the_teacher(student_and_teacher, echo_prompt_file, rollout_vllm_engine, tmp_path):
    student, teacher = student_and_teacher
    rows = run(student, echo_prompt_file, tmp_path, rollout_vllm_engine, teacher_model=teacher,
               advantage_estimator="on_policy_distill", max_samples=48, **OPD)
    assert len(rows) == 12
    kl = series(rows, "rollout/opd_reverse_kl")
    print(f"\nrollout reverse KL per step: {[round(v, 3) for v in kl]}")
    assert len(kl) == 12 and all(v > 0 for v in kl[:2])
    assert sum(kl[-4:]) < 0.7 * sum(kl[:4]), kl  # the sampled reverse KL of the rollouts falls
    before, after = heldout_kl(student, teacher), heldout_kl(str(tmp_path / "hf"), teacher)
    print(f"held-out reverse KL to the teacher: {before:.3f} -> {after:.3f} nats/token")
    assert after < 0.7 * before, (before, after)
    assert "rollout/kl" not in rows[0]  # no KL to a reference: the reference role is the teacher


@pytest.mark.parametrize("mode", [{"async_train": True, "enable_vllm_is_correction": True},
                                  {"colocate_all_models": True}], ids=["async_train", "colocate_all_models"])
def test_it_runs_async_and_colocated(student_and_teacher, echo_prompt_file, rollout_vllm_engine, tmp_path, mode):
    student, teacher = student_and_teacher
    rows = run(student, echo_prompt_file, tmp_path, rollout_vllm_engine, teacher_model=teacher,
               advantage_estimator="on_policy_distill", max_samples=12, opd_reward_weight=0.5, **OPD, **mode)
    assert len(rows) == 3
    kl = series(rows, "rollout/opd_reverse_kl")
    assert len(kl) == 3 and all(v > 0 for v in kl), kl
    assert all(r["train/grad_norm"] > 0 for r in rows)
