"""The flags of `rlhfkit batch-inference` act: the prompts it builds, the sampling it asks for, the engines it
starts and the reward source it scores with, each checked without running an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rlhfkit.inference.batch as batch
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.data.synthetic import write_jsonl

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def cfg_of(**flags):
    return parse_config("batch-inference", None, flags_to_argv({"output_path": "unused.jsonl", **flags}))


@pytest.fixture
def prompts_file(tmp_path):
    rows = [{"q": f"question {i}", "gold": i, "input": "unused", "resp": f"answer {i}"} for i in range(8)]
    rows[7]["q"] = "long " * 200  # over --prompt_max_len
    return write_jsonl(rows, tmp_path / "prompts.jsonl")


def test_prompt_flags_shape_the_prompts(tiny_model_dir, tokenizer, prompts_file):
    cfg = cfg_of(pretrain=tiny_model_dir, dataset=prompts_file, input_key="q", label_key="gold",
                 input_template="Q: {}\nA:", iter=1, rollout_batch_size=3, prompt_max_len=64, max_samples=8)
    prompts, first = batch.prompt_slice(cfg, tokenizer)
    # --iter 1 x --rollout_batch_size 3: rows 3..5; --input_key q, --label_key gold, --input_template
    assert first == 3 and [p["prompt"] for p in prompts] == [f"Q: question {i}\nA:" for i in (3, 4, 5)]
    assert [p["label"] for p in prompts] == [3, 4, 5]
    # --prompt_max_len drops the over-long row 7; --max_samples cuts the file
    everything, _ = batch.prompt_slice(cfg_of(pretrain=tiny_model_dir, dataset=prompts_file, input_key="q",
                                              prompt_max_len=64), tokenizer)
    assert len(everything) == 7
    cut, _ = batch.prompt_slice(cfg_of(pretrain=tiny_model_dir, dataset=prompts_file, input_key="q",
                                       max_samples=2), tokenizer)
    assert len(cut) == 2
    # --apply_chat_template, and --enable_csft / --csft_prompt put the condition before the prompt
    chat, _ = batch.prompt_slice(cfg_of(pretrain=tiny_model_dir, dataset=prompts_file, input_key="q", max_samples=1,
                                        apply_chat_template=True, enable_csft=True, csft_prompt="<rm_score>: 3.00"),
                                 tokenizer)
    assert chat[0]["prompt"].startswith("<|im_start|>system\n<rm_score>: 3.00<|im_end|>")
    assert "question 0" in chat[0]["prompt"]


def test_dataset_split_and_probs_pick_the_rows(tiny_model_dir, tokenizer, tmp_path):
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "splits"
    DatasetDict({"train": Dataset.from_list([{"input": f"t{i}"} for i in range(4)]),
                 "test": Dataset.from_list([{"input": f"s{i}"} for i in range(6)])}).save_to_disk(folder)
    prompts, _ = batch.prompt_slice(cfg_of(pretrain=tiny_model_dir, dataset=str(folder), dataset_split="test"),
                                    tokenizer)
    assert [p["prompt"] for p in prompts] == [f"s{i}" for i in range(6)]
    a = write_jsonl([{"input": f"a{i}"} for i in range(100)], tmp_path / "a.jsonl")
    b = write_jsonl([{"input": f"b{i}"} for i in range(100)], tmp_path / "b.jsonl")
    mixed, _ = batch.prompt_slice(cfg_of(pretrain=tiny_model_dir, dataset=f"{a},{b}", dataset_probs="0.9,0.1",
                                         max_samples=50), tokenizer)
    assert sum(p["prompt"].startswith("a") for p in mixed) > 40


def test_sampling_and_tokenizer_flags_reach_generation(tiny_model_dir, prompts_file, monkeypatch):
    seen = {}

    def fake_generate_on_engines(engines, prompt_ids, sampling):
        seen["sampling"], seen["n_prompts"] = sampling, len(prompt_ids)
        return []

    monkeypatch.setattr(batch, "generate_on_engines", fake_generate_on_engines)
    real_slice = batch.prompt_slice
    monkeypatch.setattr(batch, "prompt_slice", lambda cfg, tok: (seen.setdefault("tok", tok), real_slice(cfg, tok))[1])
    cfg = cfg_of(pretrain=tiny_model_dir, dataset=prompts_file, input_key="q", temperature=0.7, top_p=0.8,
                 top_k=7, best_of_n=3, max_new_tokens=9, seed=5, tokenizer_chat_template=TEMPLATE,
                 apply_chat_template=True, max_samples=2)
    batch.generate(cfg, engines=[object()], stats={})
    s = seen["sampling"]
    assert (s.temperature, s.top_p, s.top_k, s.n, s.max_new_tokens, s.seed) == (0.7, 0.8, 7, 3, 9, 5)
    assert seen["tok"].chat_template == TEMPLATE  # --tokenizer_chat_template
    greedy = cfg_of(pretrain=tiny_model_dir, dataset=prompts_file, input_key="q", temperature=0.7,
                    greedy_sampling=True, max_samples=2)
    batch.generate(greedy, engines=[object()], stats={})
    assert seen["sampling"].temperature == 0.0 and seen["sampling"].greedy


def test_engine_flags_reach_the_engines(tiny_model_dir, monkeypatch):
    import rlhfkit.launch.ray_cluster as ray_cluster
    import rlhfkit.rollout.hf_engine as hf_engine
    import rlhfkit.rollout.vllm_engine as vllm_engine

    seen = {}
    monkeypatch.setattr(ray_cluster, "start_ray",
                        lambda cfg: seen.setdefault("ray_address", cfg.ray_address) and False)
    monkeypatch.setattr(ray_cluster, "cluster_has_gpus", lambda: False)
    monkeypatch.setattr(vllm_engine, "create_vllm_engines",
                        lambda n, path, **kw: seen.update(vllm=(n, kw)) or ["engine"] * n)
    monkeypatch.setattr(hf_engine, "create_hf_engines", lambda n, path, **kw: seen.update(hf=(n, kw)) or ["e"] * n)
    cfg = cfg_of(pretrain=tiny_model_dir, dataset="unused", vllm_num_engines=2, tp_size=2,
                 vllm_gpu_memory_utilization=0.5, vllm_kv_cache_mb=64, enforce_eager=True, enable_prefix_caching=True,
                 prompt_max_len=100, max_new_tokens=20, param_dtype="bf16", seed=9, ray_address="10.0.0.1:6379")
    engines, _, _ = batch.start_engines(cfg, tiny_model_dir)
    n, kw = seen["vllm"]
    assert n == 2 and len(engines) == 2
    assert kw == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "cpu_kv_cache_bytes": 64 << 20,
                  "enforce_eager": True, "enable_prefix_caching": True, "max_model_len": 120, "dtype": "bfloat16",
                  "seed": 9, "log_dir": f"{cfg.output_path}.logs"}  # no --verbose: engine<k>.log beside the rows
    assert seen["ray_address"] == "10.0.0.1:6379"
    hf = cfg_of(pretrain=tiny_model_dir, dataset="unused", eval_task="generate", vllm_num_engines=3,
                param_dtype="fp32")
    batch.start_engines(hf, tiny_model_dir)
    assert seen["hf"] == (3, {"dtype": "float32", "log_dir": f"{hf.output_path}.logs"})
    loud = cfg_of(pretrain=tiny_model_dir, dataset="unused", verbose=True)
    batch.start_engines(loud, tiny_model_dir)
    assert seen["vllm"][1]["log_dir"] is None  # --verbose: the engines' logs stay on Ray's stream (the console)


def test_scoring_flags_reach_the_reward_source(tiny_model_dir, prompts_file, monkeypatch):
    import rlhfkit.rewards.sources as sources

    seen = {}

    class Source:
        name = "fake"

        def __call__(self, texts, prompts, labels):
            seen["labels"], seen["texts"] = labels, texts
            return SimpleNamespace(rewards=torch.arange(len(texts), dtype=torch.float32))

    monkeypatch.setattr(sources, "reward_source_from_config",
                        lambda specs, micro_batch_size: seen.update(specs=specs, rows=micro_batch_size) or Source())
    cfg = cfg_of(dataset=prompts_file, eval_task="rm", input_key="q", output_key="resp", label_key="gold",
                 reward_pretrain="rm-a,rm-b", remote_rm_url="builtin:exact", normalize_reward=True,
                 reward_timeout=5.0, micro_batch_size=3, max_len=77, max_samples=3, remote_rm_timeout=9.0,
                 remote_rm_retries=4, remote_rm_backoff=0.25, remote_rm_token="tok", remote_rm_max_response_mb=2.5)
    rows = batch.read_scoring_rows(cfg)
    assert [(r["input"], r["output"], r["label"]) for r in rows] == [(f"question {i}", f"answer {i}", i)
                                                                     for i in range(3)]
    batch.score(cfg, rows, {})
    specs = seen["specs"]
    assert (specs.reward_pretrain, specs.remote_rm_url, specs.normalize_reward, specs.reward_timeout,
            seen["rows"], specs.max_len) == ("rm-a,rm-b", "builtin:exact", True, 5.0, 3, 77)
    assert (specs.remote_rm_timeout, specs.remote_rm_retries, specs.remote_rm_backoff, specs.remote_rm_token,
            specs.remote_rm_max_response_mb) == (9.0, 4, 0.25, "tok", 2.5)  # tests/rewards/test_remote.py: over HTTP
    assert seen["labels"] == [0, 1, 2] and seen["texts"][0] == "question 0answer 0"
    assert [r["reward"] for r in rows] == [0.0, 1.0, 2.0]
    # --eval_task rm without a reward flag scores with --pretrain (OpenRLHF's reward model)
    batch.score(cfg_of(dataset=prompts_file, eval_task="rm", pretrain=tiny_model_dir), rows, {})
    assert seen["specs"].reward_pretrain == tiny_model_dir
