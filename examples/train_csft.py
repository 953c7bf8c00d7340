"""Conditional SFT: train on answers labelled with a quality score, then steer generation with the score.

    .venv/bin/python examples/train_csft.py                       # a 2-layer random-init model, ~1 minute on 2 cores
    .venv/bin/python examples/train_csft.py --pretrain embedded:smollm2-135m-instruct --learning_rate 5e-5

The data (`rlhfkit.data.synthetic.conditioned_rows`) pairs "Describe the <topic>." with "great <topic>" when its
`rm_score` is 5.0 and "poor <topic>" when it is 0.0. `rlhfkit sft --csft_keys rm_score --apply_chat_template` puts
each row's score into a system message `<rm_score>: 5.00` before the prompt; at generation time the same system
message (built with `rlhfkit.data.csft.csft_prompt`) asks for the quality wanted. The script prints the greedy
answers for both scores: the condition, not the prompt, decides between "great" and "poor".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain", default=None, help="model to train (default: a fresh tiny random-init model)")
    parser.add_argument("--learning_rate", default="5e-3")
    parser.add_argument("--max_epochs", default="4")
    parser.add_argument("--run", default="runs/csft-example")
    args = parser.parse_args()

    from rlhfkit.cli.sft import main as sft_main
    from rlhfkit.data.csft import csft_prompt
    from rlhfkit.data.synthetic import TOPICS, conditioned_rows, write_jsonl

    run = Path(args.run)
    data = write_jsonl(conditioned_rows(64, seed=1), run / "data" / "train.jsonl")
    model_spec = args.pretrain
    if model_spec is None:
        from rlhfkit.models.tiny import build_tiny_causal_lm

        model_spec = build_tiny_causal_lm(str(run / "tiny_lm"))
    sft_main(["--pretrain", model_spec, "--dataset", data, "--input_key", "input", "--output_key", "output",
              "--csft_keys", "rm_score", "--apply_chat_template", "--max_len", "64", "--train_batch_size", "8",
              "--micro_train_batch_size", "8", "--max_epochs", args.max_epochs, "--learning_rate", args.learning_rate,
              "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--seed", "3",
              "--run_dir", str(run / "run"), "--save_path", str(run / "model")])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    for score in (5.0, 0.0):
        condition = csft_prompt({"rm_score": score})
        for topic in TOPICS[:4]:
            messages = [{"role": "system", "content": condition}, {"role": "user", "content": f"Describe the {topic}."}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=4, do_sample=False)
            answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            print(f"{condition!r:>22}  Describe the {topic}.  ->  {answer!r}")


if __name__ == "__main__":
    main()
