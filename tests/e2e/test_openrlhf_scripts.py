"""OpenRLHF 0.11's own launch scripts run at tiny scale (#13): examples/scripts/train_sft.sh, train_rm.sh,
train_dpo_llama.sh, train_dapo_ray_hybrid_engine.sh (GRPO) and train_ppo_ray_hybrid_engine.sh (PPO with critic and
reward model), their flags unchanged but for model names, data paths
and sizes (tests/fixtures/openrlhf_scripts). Two optimizer steps each; the scripts' bf16, flash_attention_2, nccl and
sleep flags take their CPU meaning (bf16 mixed precision, sdpa, gloo, no-op)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openrlhf_scripts import groups, script_argv

from rlhfkit.config.parse import parse_config
from rlhfkit.data.synthetic import echo_rows, preference_rows, write_jsonl

pytestmark = pytest.mark.slow
RL_DIR = Path(__file__).resolve().parents[1] / "rl"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def only_run(cwd: Path) -> Path:
    [run_dir] = (cwd / "runs").iterdir()  # the default run folder, runs/<command>-<time>
    return run_dir


def conversation_pairs(n: int) -> list[dict]:
    """OpenRLHF's preference format for --apply_chat_template without --prompt_key: whole conversations."""
    def chat(prompt: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return [{"chosen": chat(r["prompt"], r["chosen"]), "rejected": chat(r["prompt"], r["rejected"])}
            for r in preference_rows(n, seed=3)]


@pytest.mark.parametrize(("script", "rows", "loss"), [
    ("train_sft.sh", [{"question": r["input"], "response": r["output"]} for r in echo_rows(8, seed=1)], "train/loss"),
    ("train_rm.sh", conversation_pairs(8), "train/loss"),
    ("train_dpo_llama.sh", conversation_pairs(8), "train/loss"),
    ("seed_readme_sft.sh", [{"question": r["input"], "response": r["output"]} for r in echo_rows(8, seed=1)],
     "train/loss"),  # the seed README's commands, flat flags
    ("seed_readme_rm.sh", conversation_pairs(8), "train/loss"),
])
def test_offline_scripts_run(script, rows, loss, tiny_model_dir, tmp_path, monkeypatch):
    import importlib

    data = write_jsonl(rows, tmp_path / "data.jsonl")
    command, argv = script_argv(script, MODEL=tiny_model_dir, DATA=data, OUT=str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)
    importlib.import_module(f"rlhfkit.cli.{command}").main(argv)
    rows_logged = metrics(only_run(tmp_path))
    assert [r["step"] for r in rows_logged if loss in r] == [1, 2]  # 8 samples / --train.batch_size 4
    out = next((tmp_path / "out").iterdir())
    assert (out / "config.json").is_file()  # --ckpt.output_dir got the HF model
    manifest = json.loads((only_run(tmp_path) / "manifest.json").read_text())
    flags = manifest.get("config") or manifest.get("flags") or {}
    assert flags.get("packing_samples") is True and flags.get("gradient_checkpointing") is True, flags


def test_grpo_script_runs(tiny_model_dir, rollout_vllm_engine, tmp_path, monkeypatch):
    from rlhfkit.rl.ppo_trainer import train_ppo

    prompts = write_jsonl([{"context_messages": r["input"]} for r in echo_rows(2, seed=4)], tmp_path / "p.jsonl")
    command, argv = script_argv("train_dapo_ray_hybrid_engine.sh", MODEL=tiny_model_dir, DATA=prompts,
                                REWARD_FUNC=str(RL_DIR / "letters_reward.py"), OUT=str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(command, groups(command), argv)
    assert (cfg.advantage_estimator, cfg.use_kl_loss, cfg.colocate_all_models, cfg.fsdp_enable_offload) == \
        ("group_norm", True, True, True)
    train_ppo(cfg, engines=[rollout_vllm_engine])
    logged = metrics(only_run(tmp_path))
    steps = [r for r in logged if "train/policy_loss" in r]
    assert len(steps) == 1 and steps[0]["rollout/reward_mean"] >= 0  # 2 prompts x 8 samples = one 16-sample step
    assert (tmp_path / "out" / "final" / "llama3-8b-rlhf" / "config.json").is_file()


def test_ppo_script_with_critic_and_reward_model_runs(tiny_model_dir, tiny_reward_model_dir, rollout_vllm_engine,
                                                      tmp_path, monkeypatch):
    """train_ppo_ray_hybrid_engine.sh: PPO with GAE, a critic, a reward model and a reference, all colocated with the
    engine, packed, dotted flags only. The seed README's PPO command parses to the same run
    (tests/config/test_dialect.py::test_the_seed_ppo_command_means_what_todays_ppo_script_means)."""
    from rlhfkit.rl.ppo_trainer import train_ppo

    prompts = write_jsonl([{"context_messages": r["input"]} for r in echo_rows(4, seed=5)], tmp_path / "p.jsonl")
    command, argv = script_argv("train_ppo_ray_hybrid_engine.sh", MODEL=tiny_model_dir,
                                REWARD_MODEL=tiny_reward_model_dir, DATA=prompts, OUT=str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)
    cfg = parse_config(command, groups(command), argv)
    assert (cfg.advantage_estimator, cfg.reward_pretrain, cfg.packing_samples, cfg.colocate_all_models) == \
        ("gae", tiny_reward_model_dir, True, True)
    train_ppo(cfg, engines=[rollout_vllm_engine])
    steps = [r for r in metrics(only_run(tmp_path)) if "train/policy_loss" in r]
    assert len(steps) == 1 and steps[0]["train/critic_grad_norm"] > 0 and "rollout/kl" in steps[0]
    assert (tmp_path / "out" / "final" / "llama3-8b-rlhf" / "config.json").is_file()


def test_mixtral_lora_sft_script_runs_on_a_tiny_mixture_of_experts(tmp_path, monkeypatch):
    """train_sft_mixtral_lora.sh on a tiny Qwen3-MoE: LoRA rank 8, packing, and the router balancing loss
    (--model.aux_loss_coef), which the step logs."""
    import importlib

    from rlhfkit.models.tiny import build_tiny_moe_causal_lm

    model = build_tiny_moe_causal_lm(str(tmp_path / "moe"))
    rows = [{"question": r["input"], "response": r["output"]} for r in echo_rows(8, seed=1)]
    data = write_jsonl(rows, tmp_path / "data.jsonl")
    command, argv = script_argv("train_sft_mixtral_lora.sh", MODEL=model, DATA=data, OUT=str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)
    importlib.import_module(f"rlhfkit.cli.{command}").main(argv)
    logged = [r for r in metrics(only_run(tmp_path)) if "train/loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["train/aux_loss"] > 0 for r in logged), logged
    assert (tmp_path / "out" / "mixtral-sft-lora" / "adapter_config.json").is_file()  # a LoRA run saves the adapter
