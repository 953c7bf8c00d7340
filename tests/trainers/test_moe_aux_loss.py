"""Mixture of experts in the offline loop: SFT and DPO train the tiny Qwen3-MoE, and --aux_loss_coef adds exactly
coef x the Switch-Transformer load-balancing loss (computed here independently, in float64, from the router logits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_reference import reference_aux_loss

from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.errors import ConfigError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from rlhfkit.models.tiny import build_tiny_moe_causal_lm

    return build_tiny_moe_causal_lm(str(tmp_path_factory.mktemp("moe") / "model"), seed=3)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sft_args(model: str, data: str, out: Path, **extra) -> list[str]:
    return flags_to_argv({"pretrain": model, "dataset": data, "input_key": "input", "output_key": "output",
                          "apply_chat_template": True, "max_len": 64, "train_batch_size": 8,
                          "micro_train_batch_size": 8, "learning_rate": 3e-3, "lr_warmup_ratio": 0.0, "seed": 5,
                          "param_dtype": "fp32", "run_dir": str(out / "run"), "save_path": str(out / "hf"), **extra})


def test_sft_on_moe_adds_aux_loss_coef_times_the_load_balancing_loss(moe_dir, tmp_path):
    """--aux_loss_coef 0.5: the first step's train/loss minus the same step's with coef 0 is 0.5 x the load-balancing
    loss of the batch, recomputed here from the initial model's router logits; train/aux_loss logs it; the loss
    falls over the run; a dense model refuses the flag."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.cli.sft import main as sft_main
    from rlhfkit.data.collate import collate_padded, model_inputs
    from rlhfkit.data.sft import build_sft_samples
    from rlhfkit.models.loading import load_tokenizer

    data = write_jsonl(echo_rows(16, seed=4), tmp_path / "train.jsonl")
    coef = 0.5
    sft_main(sft_args(moe_dir, data, tmp_path / "off", max_epochs=1))
    sft_main(sft_args(moe_dir, data, tmp_path / "on", max_epochs=2, aux_loss_coef=coef))
    off, on = metrics(tmp_path / "off" / "run"), metrics(tmp_path / "on" / "run")
    first_off = next(r for r in off if r["step"] == 1)
    first_on = next(r for r in on if r["step"] == 1)
    assert "train/aux_loss" not in first_off
    # the first global batch, as the loop draws it (one micro-batch of 8), through the initial model
    from rlhfkit.data.readers import blend_datasets
    from rlhfkit.trainers.loop import epoch_order

    tokenizer = load_tokenizer(moe_dir)
    rows = blend_datasets(data, None, split="train", seed=5)
    samples, _ = build_sft_samples(rows, tokenizer, input_key="input", output_key="output", input_template=None,
                                   apply_chat_template=True, max_len=64)
    batch = collate_padded([samples[i] for i in epoch_order(len(samples), 5, 0)[:8]], tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**model_inputs(batch), output_router_logits=True)
    aux = reference_aux_loss(out.router_logits, batch["attention_mask"], 4, 2)
    assert aux > 1.0  # E * sum f P >= top_k-ish scale; not a silent zero
    assert first_on["train/aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert first_on["train/loss"] - first_off["train/loss"] == pytest.approx(coef * aux, rel=1e-4, abs=1e-5)
    losses = [r["train/loss"] for r in on if "train/loss" in r]
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match="--aux_loss_coef 0.5: the model is not a mixture of experts"):
        from rlhfkit.models.tiny import build_tiny_causal_lm

        dense = build_tiny_causal_lm(str(tmp_path / "dense"))
        sft_main(sft_args(dense, data, tmp_path / "dense_run", aux_loss_coef=coef))


def test_dpo_trains_the_moe_model_with_aux_loss(moe_dir, tmp_path):
    """DPO on the tiny MoE with --aux_loss_coef: runs, logs train/aux_loss, the preference loss falls."""
    from rlhfkit.cli.dpo import main as dpo_main
    from rlhfkit.data.synthetic import preference_rows

    data = write_jsonl(preference_rows(16, seed=2), tmp_path / "pairs.jsonl")
    dpo_main(flags_to_argv({"pretrain": moe_dir, "dataset": data, "prompt_key": "prompt", "chosen_key": "chosen",
                            "rejected_key": "rejected", "apply_chat_template": True, "max_len": 64,
                            "train_batch_size": 8, "micro_train_batch_size": 4, "max_epochs": 2,
                            "learning_rate": 3e-3, "lr_warmup_ratio": 0.0, "param_dtype": "fp32", "beta": 0.5,
                            "aux_loss_coef": 0.01, "run_dir": str(tmp_path / "run"),
                            "save_path": str(tmp_path / "hf")}))
    rows = [r for r in metrics(tmp_path / "run") if "train/loss" in r]
    assert all(r["train/aux_loss"] > 0 for r in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
