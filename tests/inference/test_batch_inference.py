"""`rlhfkit batch-inference` on the real vLLM engine and the tiny models: generation, scoring, post-processing,
iterative slices, and the DPO round trip of iterative DPO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from letters_reward import reward_func as letters_reward_func

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.errors import ConfigError
from rlhfkit.inference.batch import run_batch_inference

pytestmark = pytest.mark.slow
LETTERS = Path(__file__).parents[1] / "rl" / "letters_reward.py"


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> str:
    return write_jsonl(echo_rows(6, seed=4), tmp_path_factory.mktemp("bi") / "prompts.jsonl")


def config(model: str, dataset: str, out: Path, **flags):
    base = {"pretrain": model, "dataset": dataset, "output_path": str(out), "input_key": "input",
            "apply_chat_template": True, "max_new_tokens": 8, "prompt_max_len": 128, "best_of_n": 3, "seed": 7}
    return parse_config("batch-inference", None, flags_to_argv({**base, **flags}))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_scores_and_slices_reproducibly(tiny_model_dir, prompt_file, rollout_vllm_engine, tmp_path):
    full = tmp_path / "full.jsonl"
    stats = run_batch_inference(config(tiny_model_dir, prompt_file, full, label_key="label",
                                       remote_rm_url=str(LETTERS)), engines=[rollout_vllm_engine])
    rows = read(full)
    assert stats["prompts"] == 6 and stats["samples"] == 18 == stats["rows_written"] == len(rows)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, j) for i in range(6) for j in range(3)]
    assert len({r["output"] for r in rows}) > 6  # sampled, not one answer per prompt
    expected = letters_reward_func([r["input"] + r["output"] for r in rows], [r["input"] for r in rows], None)
    assert [r["reward"] for r in rows] == pytest.approx(expected["rewards"])
    assert all(r["label"] and r["input"].startswith("<|im_start|>") for r in rows)
    # --iter 1 with 2 prompts per slice is rows 6..11 of the whole run: seeds follow the global prompt index
    part = tmp_path / "iter1.jsonl"
    run_batch_inference(config(tiny_model_dir, prompt_file, part, label_key="label", iter=1, rollout_batch_size=2),
                        engines=[rollout_vllm_engine])
    assert [(r["input"], r["output"]) for r in read(part)] == [(r["input"], r["output"]) for r in rows[6:12]]


def test_rm_task_and_rejection_sampling_pick_the_best_scored_output(tiny_model_dir, tiny_reward_model_dir,
                                                                    prompt_file, rollout_vllm_engine, tmp_path):
    generated = tmp_path / "gen.jsonl"
    run_batch_inference(config(tiny_model_dir, prompt_file, generated), engines=[rollout_vllm_engine])
    scored, best = tmp_path / "scored.jsonl", tmp_path / "best.jsonl"
    run_batch_inference(config(tiny_reward_model_dir, str(generated), scored, eval_task="rm"))
    run_batch_inference(config(tiny_reward_model_dir, str(generated), best, eval_task="rm", post_processor="rs"))
    scored_rows, best_rows = read(scored), read(best)
    assert len(scored_rows) == 18 and len(best_rows) == 6
    for row in best_rows:
        group = [r for r in scored_rows if r["input"] == row["input"]]
        assert len(group) == 3 and row["reward"] == max(r["reward"] for r in group)
        assert row["output"] == max(group, key=lambda r: r["reward"])["output"]


def test_iterative_dpo_round_trip(tiny_model_dir, prompt_file, rollout_vllm_engine, tmp_path):
    """One round of iterative DPO: sample 4 per prompt, pair best against worst, train DPO on the pairs."""
    from rlhfkit.cli.dpo import main as dpo_main

    pairs = tmp_path / "pairs.jsonl"
    stats = run_batch_inference(config(tiny_model_dir, prompt_file, pairs, best_of_n=4, remote_rm_url=str(LETTERS),
                                       post_processor="iter_dpo"), engines=[rollout_vllm_engine])
    rows = read(pairs)
    post = stats["iter_dpo"]
    assert post["rows"] == len(rows) > 0 and post["rows"] + post["skipped_all_equal"] == 6
    assert all(r["chosen_reward"] > r["rejected_reward"] for r in rows)
    dpo_main(flags_to_argv({"pretrain": tiny_model_dir, "dataset": str(pairs), "prompt_key": "prompt",
                            "chosen_key": "chosen", "rejected_key": "rejected", "max_len": 128,
                            "train_batch_size": 2, "micro_train_batch_size": 1, "max_epochs": 1,
                            "run_dir": str(tmp_path / "dpo"), "save_path": str(tmp_path / "dpo_model")}))
    assert (tmp_path / "dpo_model" / "config.json").exists()
    metrics = read(tmp_path / "dpo" / "metrics.jsonl")
    assert any("train/loss" in m for m in metrics)


def test_the_command_starts_its_own_engine(tiny_model_dir, prompt_file, ray_cluster, tmp_path, capsys):
    """`rlhfkit batch-inference --eval_task generate` end to end: its own (transformers) engine actor."""
    from rlhfkit.cli.batch_inference import main

    out = tmp_path / "hf.jsonl"
    main(flags_to_argv({"pretrain": tiny_model_dir, "dataset": prompt_file, "output_path": str(out),
                        "apply_chat_template": True, "eval_task": "generate", "max_new_tokens": 4,
                        "greedy_sampling": True, "best_of_n": 2, "max_samples": 2}))
    rows = read(out)
    assert len(rows) == 4 and rows[0]["output"] == rows[1]["output"]  # greedy: both samples agree
    printed = capsys.readouterr().out
    assert "wrote 4 rows" in printed
    assert "fp32 (auto pinned to fp32 by RLHFKIT_AUTO_DTYPE)" in printed  # the resolved precision is reported


@pytest.mark.parametrize("flags, message", [
    ({"output_path": None}, "--output_path is required"),
    ({"post_processor": "rs"}, "--post_processor rs needs rewards"),
    ({"post_processor": "iter_dpo", "best_of_n": 1, "remote_rm_url": "builtin:exact"}, "set --best_of_n >= 2"),
    ({"iter": 5, "rollout_batch_size": 4}, "--iter 5 x --rollout_batch_size 4 = 20 is past the 6 rows"),
])
def test_bad_flags_name_the_culprit(tiny_model_dir, prompt_file, tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        run_batch_inference(config(tiny_model_dir, prompt_file, tmp_path / "x.jsonl", **flags), engines=[])


def test_rm_task_wants_text_rows(tiny_reward_model_dir, tmp_path):
    path = write_jsonl([{"input": [{"role": "user", "content": "hi"}], "output": "hello"}], tmp_path / "chat.jsonl")
    with pytest.raises(Exception, match="chat.jsonl line 1: --eval_task rm scores text"):
        run_batch_inference(config(tiny_reward_model_dir, path, tmp_path / "o.jsonl", eval_task="rm"))
