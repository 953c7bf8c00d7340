"""`rlhfkit ppo --lora_rank N`: the actor trains LoRA adapters, the engines serve the merged weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from ppo_helpers import run, series

from rlhfkit.data.synthetic import echo_rows, write_jsonl

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_lora_actor_syncs_merged_weights_to_the_engine(tiny_model_dir, rollout_vllm_engine, tokenizer, tmp_path):
    from safetensors.torch import load_file

    from rlhfkit.cli.lora_merge import main as lora_merge
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.logprobs import response_log_probs

    prompts = write_jsonl(echo_rows(16, seed=3), tmp_path / "prompts.jsonl")
    rows = run(tiny_model_dir, prompts, tmp_path, rollout_vllm_engine, lora_rank=8, lora_alpha=16)
    assert len(rows) == 4 and all(r["train/grad_norm"] > 0 for r in rows)
    # every rollout was sampled from the weights the trainer had: the merged adapters reached the engine
    assert max(series(rows, "rollout/logprob_abs_diff_mean")) < 1e-3
    adapter = tmp_path / "hf"
    assert (adapter / "adapter_config.json").exists()
    lora_b = [t for k, t in load_file(adapter / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and max(float(t.abs().max()) for t in lora_b) > 0  # trained (lora_B starts at 0)
    # the merged final adapter is what the engine serves after the last sync
    merged_dir = lora_merge(["--pretrain", tiny_model_dir, "--lora_path", str(adapter),
                             "--output_path", str(tmp_path / "merged")])
    merged = load_causal_lm(merged_dir).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat: red cat"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    response = tokenizer("red cat", add_special_tokens=False)["input_ids"]
    [engine_logp] = ray.get(rollout_vllm_engine.score.remote([prompt], [response]))
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        want = response_log_probs(merged, ids, torch.ones_like(ids))[0, len(prompt) - 1:].tolist()
        base = response_log_probs(load_causal_lm(tiny_model_dir), ids, torch.ones_like(ids))[0, len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(engine_logp, want)) < 1e-4
    assert max(abs(a - b) for a, b in zip(want, base.tolist())) > 1e-2  # and it is not the base model


def test_lora_merge_names_a_missing_adapter(tmp_path, tiny_model_dir, capsys):
    from rlhfkit.cli.main import main

    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as exit_info:
        main(["lora-merge", "--pretrain", tiny_model_dir, "--lora_path", str(missing),
              "--output_path", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    # the flag, the file it lacks, and what the folder must be
    assert (f"rlhfkit lora-merge: error: --lora_path {missing}: {missing / 'adapter_config.json'} not found: "
            f"'{missing}' is not a peft adapter folder") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_qlora_actor_syncs_dequantized_merged_weights(tiny_model_dir, rollout_vllm_engine, tmp_path):
    """`ppo --load_in_4bit --lora_rank 8`: the actor trains adapters on an NF4 base; every sync sends the dequantized
    base plus the merged adapters, so the engine's log-probs match the trainer's after each sync."""
    pytest.importorskip("bitsandbytes")
    prompts = write_jsonl(echo_rows(16, seed=3), tmp_path / "prompts.jsonl")
    rows = run(tiny_model_dir, prompts, tmp_path, rollout_vllm_engine, lora_rank=8, lora_alpha=16, load_in_4bit=True)
    assert len(rows) == 4 and all(r["train/grad_norm"] > 0 for r in rows)
    assert max(series(rows, "rollout/logprob_abs_diff_mean")) < 1e-3
    assert (tmp_path / "hf" / "adapter_config.json").exists()
