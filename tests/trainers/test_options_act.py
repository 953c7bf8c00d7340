"""The shared flags of the offline commands (sft, rm, dpo, kto, kd, prm) act: each command is run up to the
training loop with non-default flags, and what the loop receives (model, engine, tokenizer, samples) is checked;
the engine's flags are checked on the optimizer and schedule they build (against closed forms)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, preference_rows, process_rows, unpaired_rows, write_jsonl
from rlhfkit.errors import ConfigError

ROWS = {"sft": echo_rows, "kd": echo_rows, "rm": preference_rows, "dpo": preference_rows, "kto": unpaired_rows,
        "prm": lambda n, seed: process_rows(n, seed=seed, steps=(1, 3))}
CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


class Reached(Exception):
    """Raised by the stand-in training loop once it has seen what the command hands it."""


# The rows' keys are renamed (input -> question, output -> answer, label -> verdict, prompt -> query): the command
# finds them only through --input_key / --output_key / --label_key / --prompt_key.
RENAMED = {"input": "question", "output": "answer", "label": "verdict", "prompt": "query"}


def _extra_flags(command: str, tiny_model_dir: str) -> dict:
    keys = {"input_key": "question", "output_key": "answer"}
    return {"sft": keys, "kd": {**keys, "teacher_model": tiny_model_dir},
            "rm": {"prompt_key": "query"}, "dpo": {"prompt_key": "query"}, "kto": {**keys, "label_key": "verdict"},
            "prm": {"input_key": "question", "label_key": "verdict", "placeholder_token": "§",
                    "reward_tokens": ["+", "-"]}}[command]


def _split_folder(command: str, root: Path) -> str:
    """A save_to_disk DatasetDict: split 'train' with 16 rows, split 'held' with 24, split 'check' with 8."""
    from datasets import Dataset, DatasetDict

    rows = [{RENAMED.get(k, k): v for k, v in row.items()} for row in ROWS[command](48, 1)]
    path = root / f"{command}_splits"
    DatasetDict({"train": Dataset.from_list(rows[:16]), "held": Dataset.from_list(rows[16:40]),
                 "check": Dataset.from_list(rows[40:])}).save_to_disk(path)
    return str(path)


def _reach_loop(monkeypatch, command: str, flags: dict) -> dict:
    """Run `rlhfkit <command>` with `flags` until the training loop starts; return what the loop was given."""
    import rlhfkit.trainers.common as common

    seen: dict = {}

    def stand_in(cfg, dist_info, engine, tokenizer, method, train_samples, plan, eval_samples=None, **_):
        seen.update(cfg=cfg, engine=engine, tokenizer=tokenizer, train=train_samples, eval=eval_samples, plan=plan,
                    method=method, deterministic=torch.are_deterministic_algorithms_enabled())
        raise Reached

    monkeypatch.setattr(common, "train_offline", stand_in)
    main = importlib.import_module(f"rlhfkit.cli.{command}").main
    try:
        with pytest.raises(Reached):
            main(flags_to_argv(flags))
    finally:
        torch.use_deterministic_algorithms(False)
    return seen


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto", "kd", "prm"])
def test_offline_scaffold_flags_reach_the_model_data_and_engine(command, tiny_model_dir, tmp_path, monkeypatch):
    """Also --input_key / --output_key / --label_key / --prompt_key: the rows' keys are renamed (RENAMED)."""
    folder = _split_folder(command, tmp_path)
    flags = {"pretrain": tiny_model_dir, "dataset": folder, "dataset_split": "held", "max_samples": 20,
             "eval_dataset": folder, "eval_split": "check", "train_batch_size": 4, "micro_train_batch_size": 2,
             "max_epochs": 3, "attn_implementation": "eager", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.25,
             "target_modules": ["q_proj", "v_proj"], "tokenizer_chat_template": CUSTOM_TEMPLATE,
             "full_determinism": True, "packing_samples": True, "seed": 11, "run_dir": str(tmp_path / "run"),
             "save_path": str(tmp_path / "hf"), **_extra_flags(command, tiny_model_dir)}
    seen = _reach_loop(monkeypatch, command, flags)
    # --dataset_split held (24 rows) cut by --max_samples 20; --eval_split check (8 rows, not train's 16)
    assert len(seen["train"]) == 20 and len(seen["eval"]) == 8
    # --train_batch_size 4 / --micro_train_batch_size 2 on one rank; --max_epochs 3
    assert (seen["plan"].accumulation, seen["plan"].steps_per_epoch, seen["plan"].total_steps) == (2, 5, 15)
    model = seen["engine"].model
    assert model.config._attn_implementation == "eager"
    lora = model.peft_config["default"]  # --lora_rank / --lora_alpha / --lora_dropout / --target_modules
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8, 0.25)
    assert set(lora.target_modules) == {"q_proj", "v_proj"}
    adapted = {name.split(".")[-4] for name, p in model.named_parameters() if p.requires_grad and "lora_A" in name}
    assert adapted == {"q_proj", "v_proj"}
    assert seen["tokenizer"].chat_template == CUSTOM_TEMPLATE  # --tokenizer_chat_template
    assert seen["deterministic"]  # --full_determinism
    # --packing_samples: a micro-batch is one packed row with per-sample lengths
    from rlhfkit.data.collate import is_packed

    batch = seen["method"].collate(seen["train"][:2])
    parts = [batch] if is_packed(batch) else [v for v in batch.values() if isinstance(v, dict) and is_packed(v)]
    assert parts and all(part["input_ids"].shape[0] == 1 for part in parts)  # (kto: completion and mismatched)
    assert seen["cfg"].seed == 11 and (tmp_path / "run" / "manifest.json").is_file()  # --run_dir


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto", "kd"])
def test_parallel_flags_are_checked_against_the_world_by_the_command(command, tiny_model_dir, tmp_path):
    """--ring_attn_size, --ring_head_stride and (sft, rm, dpo, kto) --tp_size, the alias of --ds_tensor_parallel_size,
    as the command parses them, reach its scaffold's set-up (setup_context_parallel, setup_tp) before any data is
    read: in this one-process world a ring or tensor-parallel group of 2 ranks cannot be formed, and a head stride
    without a ring is refused. (The 2-rank runs that split sequences and weights are tests/e2e/test_ring_attention.py
    and tests/e2e/test_tensor_parallel.py.)"""
    import re

    main = importlib.import_module(f"rlhfkit.cli.{command}").main
    base = ["--pretrain", tiny_model_dir, "--dataset", str(tmp_path / "never_read.jsonl")]
    base += ["--teacher_model", tiny_model_dir] if command == "kd" else []
    cases = [(["--ring_attn_size", "2"], "--ring_attn_size 2 must divide the world size 1"),
             (["--ring_head_stride", "2"], "--ring_head_stride 2 acts only with --ring_attn_size > 1")]
    if command != "kd":  # kd refuses the tensor-parallel flags when parsing (test_tensor_parallel.py)
        cases.append((["--tp_size", "2"], "--ds_tensor_parallel_size 2 must divide the world size 1"))
    for flags, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            main(base + flags)


def test_dataset_probs_mix_the_training_sets(tiny_model_dir, tmp_path):
    from rlhfkit.cli.sft import GROUPS
    from rlhfkit.config.parse import parse_config
    from rlhfkit.trainers.common import load_split

    a = write_jsonl([{"input": f"a{i}", "output": "x"} for i in range(200)], tmp_path / "a.jsonl")
    b = write_jsonl([{"input": f"b{i}", "output": "y"} for i in range(200)], tmp_path / "b.jsonl")

    def share_of_a(probs: str | None) -> float:
        argv = ["--dataset", f"{a},{b}", "--max_samples", "100"] + (["--dataset_probs", probs] if probs else [])
        cfg = parse_config("sft", GROUPS, argv)
        rows = list(load_split(cfg, cfg.dataset, cfg.dataset_split, cfg.dataset_probs, cfg.max_samples))
        assert len(rows) == 100
        return sum(r["input"].startswith("a") for r in rows) / len(rows)

    assert share_of_a("0.9,0.1") > 0.75 and share_of_a("0.1,0.9") < 0.25


# ------------------------------------------------------------------------------------------------------------
# The engine (TrainEngine: offline loop, and the PPO actor and critic)


def _engine(tiny_model_dir: str, argv: list[str], total_steps: int = 10, command: str = "sft"):
    from rlhfkit.cli.sft import GROUPS
    from rlhfkit.config.parse import parse_config
    from rlhfkit.engine.distributed import DistInfo
    from rlhfkit.engine.train_engine import TrainEngine
    from rlhfkit.models.loading import load_causal_lm

    cfg = parse_config(command, GROUPS if command == "sft" else None, argv)
    torch.manual_seed(0)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return TrainEngine(load_causal_lm(tiny_model_dir), cfg, info, total_steps)


def _lr_curve(engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(engine.lr)
        engine.optimizer.step()
        engine.scheduler.step()
    return out


def test_lr_flags_shape_the_schedule(tiny_model_dir):
    """--learning_rate, --lr_warmup_ratio, --lr_scheduler and --min_lr_ratio against the closed forms."""
    peak, total = 1e-3, 10

    def reference(step: int, warmup: int, schedule: str, floor: float) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        p = (step - warmup) / (total - warmup)
        if schedule == "constant":
            return peak
        if schedule == "linear":
            return peak * (1 - p)
        floor = floor if schedule == "cosine_with_min_lr" else 0.0
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))

    for schedule, warmup_ratio, floor in [("cosine_with_min_lr", 0.2, 0.3), ("cosine", 0.0, 0.3),
                                          ("linear", 0.3, 0.1), ("constant", 0.1, 0.1)]:
        engine = _engine(tiny_model_dir, ["--learning_rate", str(peak), "--lr_warmup_ratio", str(warmup_ratio),
                                          "--lr_scheduler", schedule, "--min_lr_ratio", str(floor)], total)
        warmup = math.ceil(total * warmup_ratio)
        expected = [reference(s, warmup, schedule, floor) for s in range(total)]
        assert _lr_curve(engine, total) == pytest.approx(expected, rel=1e-9), schedule
    # the floor is reached at the end of cosine_with_min_lr and differs with --min_lr_ratio
    a = _engine(tiny_model_dir, ["--learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--min_lr_ratio", "0.5"], 4)
    assert _lr_curve(a, 5)[-1] == pytest.approx(5e-4)


def test_adam_betas_and_l2_reach_the_optimizer(tiny_model_dir):
    engine = _engine(tiny_model_dir, ["--adam_betas", "0.8", "0.9", "--l2", "0.05"])
    groups = engine.optimizer.param_groups
    assert all(g["betas"] == (0.8, 0.9) for g in groups)
    # --l2 is the weight decay of the matrices; biases and norm weights (1-D) never decay
    assert {g["weight_decay"] for g in groups if g["params"][0].ndim >= 2} == {0.05}
    assert {g["weight_decay"] for g in groups if g["params"][0].ndim < 2} == {0.0}
    # one AdamW step on a known gradient: compare with torch's reference AdamW with those betas and decay
    param = next(p for p in engine.model.parameters() if p.ndim == 2)
    before = param.detach().clone()
    for p in engine.model.parameters():
        p.grad = torch.zeros_like(p)
    grad = torch.full_like(param, 0.01)
    param.grad = grad.clone()
    ref = torch.nn.Parameter(before.clone())
    ref.grad = grad.clone()
    ref_opt = torch.optim.AdamW([ref], lr=engine.lr, betas=(0.8, 0.9), weight_decay=0.05)
    engine.optimizer.step()
    ref_opt.step()
    assert torch.allclose(param.detach(), ref.detach(), atol=1e-7)


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto", "kd", "prm"])
def test_max_norm_clips_the_gradient(tiny_model_dir, command):
    """Each offline command's --max_norm reaches its engine (one TrainEngine for all of them): the gradients the step
    applies (divided by the optimizer's grad_scale, where the clip is folded into torch's fused AdamW) have norm
    max_norm."""
    norms = {}
    for max_norm in ("0.5", "0"):
        engine = _engine(tiny_model_dir, ["--max_norm", max_norm], command=command)
        for p in engine.model.parameters():
            p.grad = torch.ones_like(p)
        full = torch.sqrt(sum((p.grad ** 2).sum() for p in engine.model.parameters())).item()
        stepped = {}
        original = engine.optimizer.step

        def spy(*args, _original=original, _engine=engine, _stepped=stepped, **kwargs):
            grads = [p.grad for p in _engine.model.parameters() if p.grad is not None]
            divisor = float(getattr(_engine.optimizer, "grad_scale", 1.0))  # the fused AdamW's folded clip
            _stepped["norm"] = torch.sqrt(sum((g ** 2).sum() for g in grads)).item() / divisor
            return _original(*args, **kwargs)

        engine.optimizer.step = spy
        reported = engine.optimizer_step()
        assert reported == pytest.approx(full, rel=1e-5)  # the pre-clip norm is what gets logged
        norms[max_norm] = stepped["norm"]
    assert norms["0.5"] == pytest.approx(0.5, rel=1e-4)
    assert norms["0"] == pytest.approx(full, rel=1e-5)  # --max_norm 0: no clipping


def test_gradient_checkpointing_flags_reach_the_model(tiny_model_dir):
    plain = _engine(tiny_model_dir, [])
    assert not plain.model.is_gradient_checkpointing
    for reentrant in (True, False):
        argv = ["--gradient_checkpointing"] + (["--gradient_checkpointing_use_reentrant"] if reentrant else [])
        engine = _engine(tiny_model_dir, argv)
        assert engine.model.is_gradient_checkpointing and engine.model.config.use_cache is False
        funcs = {m._gradient_checkpointing_func for m in engine.model.modules()
                 if getattr(m, "gradient_checkpointing", False)}
        assert funcs and {f.keywords["use_reentrant"] for f in funcs} == {reentrant}


def test_zero_stage_decides_whether_parameters_stay_gathered_after_forward(tiny_model_dir):
    """FSDP2 with bf16 compute on one gloo rank: --zero_stage 2 keeps the gathered (plain) parameters from
    forward to backward, 3 reshards them (DTensor) right after forward. (One rank in bf16 trains on master weights
    without FSDP2, rlhfkit.engine.master_weights; --adam_offload keeps it on FSDP2, as several ranks do.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlhfkit.engine.distributed import free_port

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        kinds = {}
        for stage in ("2", "3"):
            engine = _engine(tiny_model_dir, ["--zero_stage", stage, "--param_dtype", "bf16", "--adam_offload"])
            engine.model(input_ids=torch.tensor([[1, 2, 3, 4]]))
            layer = engine.model.model.layers[0]
            kinds[stage] = isinstance(next(layer.parameters()), DTensor)
        assert kinds == {"2": False, "3": True}
    finally:
        if owned:
            dist.destroy_process_group()


def test_shared_flags_ppo_does_not_act_on_are_refused(tmp_path):
    from rlhfkit.cli.ppo import GROUPS
    from rlhfkit.config.parse import COMMAND_REJECTED_FLAGS, parse_config

    for flag, value in [("learning_rate", "1e-5"), ("logging_steps", "5"), ("full_determinism", None)]:
        argv = [f"--{flag}"] + ([value] if value else [])
        with pytest.raises(ConfigError, match=f"--{flag} is not supported by 'rlhfkit ppo'") as err:
            parse_config("ppo", GROUPS, argv)
        assert COMMAND_REJECTED_FLAGS["ppo"][flag] in str(err.value)
        config = tmp_path / f"{flag}.yaml"
        config.write_text(f"{flag}: {value or 'true'}\n")
        with pytest.raises(ConfigError, match=f"--{flag} is not supported"):
            parse_config("ppo", GROUPS, ["--config", str(config)])
    # the offline commands act on them
    from rlhfkit.cli.sft import GROUPS as SFT_GROUPS

    cfg = parse_config("sft", SFT_GROUPS, ["--learning_rate", "1e-5", "--logging_steps", "5", "--full_determinism"])
    assert (cfg.learning_rate, cfg.logging_steps, cfg.full_determinism) == (1e-5, 5, True)


def test_pair_commands_refuse_row_keys_and_a_loss_outside_float32():
    """rm and dpo read --prompt_key/--chosen_key/--rejected_key, never --input_key/--output_key: refused (they were
    accepted and ignored); rm's loss is float32 always: --compute_fp32_loss is the default, its negation refused."""
    from rlhfkit.cli import dpo, rm
    from rlhfkit.config.parse import parse_config

    for command, module in (("rm", rm), ("dpo", dpo)):
        for flag in ("input_key", "output_key"):
            with pytest.raises(ConfigError, match=f"--{flag} is not supported by 'rlhfkit {command}': {command} "
                                                  "reads chosen/rejected pairs.*--prompt_key, --chosen_key"):
                parse_config(command, module.GROUPS, [f"--{flag}", "question"])
    assert parse_config("rm", rm.GROUPS, []).compute_fp32_loss is True
    assert parse_config("rm", rm.GROUPS, ["--compute_fp32_loss"]).compute_fp32_loss is True  # OpenRLHF's switch
    with pytest.raises(ConfigError, match="--no-compute_fp32_loss: rlhfkit computes the reward-model loss in float32"):
        rm.main(["--pretrain", "m", "--dataset", "d", "--no-compute_fp32_loss"])


def test_deepspeed_flags_are_refused_with_their_reason(tmp_path):
    from rlhfkit.cli.sft import GROUPS
    from rlhfkit.config.parse import REJECTED_FLAGS, parse_config, rejection_reason

    assert "aux_loss_coef" not in REJECTED_FLAGS  # implemented: tests/trainers/test_moe_aux_loss.py
    for flag in REJECTED_FLAGS:  # sft's reason (tests/config/test_parse.py: every command's names its own flags)
        with pytest.raises(ConfigError, match=f"--{flag} is not supported") as err:
            parse_config("sft", GROUPS, [f"--{flag}", "1"])
        assert rejection_reason(flag, "sft") in str(err.value)


def test_logging_eval_checkpoint_and_tracker_flags_of_a_short_run(tiny_model_dir, tmp_path, monkeypatch):
    """One 4-step SFT run: --logging_steps 2 logs steps 2 and 4, --eval_steps 3 evaluates before training and at
    step 3 (not at the epoch's end), --save_steps 2 with --save_hf_ckpt writes HF folders inside the checkpoints of
    --ckpt_path (at most --max_ckpt_num 1 kept), --save_path gets the final model, TensorBoard and W&B get the
    --wandb_* names."""
    import json

    import wandb

    from rlhfkit.cli.sft import main as sft_main

    calls = {}

    class FakeRun:
        def log(self, scalars, step):
            calls.setdefault("steps", []).append(step)

        def finish(self):
            calls["finished"] = True

    def fake_init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    train = write_jsonl(echo_rows(16, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(echo_rows(4, seed=2), tmp_path / "eval.jsonl")
    run = tmp_path / "run"
    sft_main(flags_to_argv({
        "pretrain": tiny_model_dir, "dataset": train, "eval_dataset": held_out, "output_key": "output",
        "max_len": 48, "train_batch_size": 4, "micro_train_batch_size": 4, "max_epochs": 1, "logging_steps": 2,
        "eval_steps": 3, "save_steps": 2, "save_hf_ckpt": True, "ckpt_path": str(tmp_path / "ckpt"),
        "max_ckpt_num": 1, "save_path": str(tmp_path / "final"), "run_dir": str(run),
        "use_tensorboard": str(tmp_path / "tb"), "use_wandb": "offline", "wandb_org": "org", "wandb_group": "grp",
        "wandb_project": "proj", "wandb_run_name": "name"}))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4]
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 3]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step4"]
    assert (tmp_path / "ckpt" / "global_step4" / "hf" / "config.json").is_file()
    assert (tmp_path / "final" / "config.json").is_file()
    assert list((tmp_path / "tb" / "run").glob("events.out.tfevents.*"))
    init = calls["init"]
    assert (init["project"], init["entity"], init["group"], init["name"]) == ("proj", "org", "grp", "name")
    assert calls["steps"] == [0, 2, 3, 4] and calls["finished"]


def test_preference_keys_and_the_rm_margin(tokenizer):
    from rlhfkit.cli.rm import GROUPS
    from rlhfkit.config.parse import parse_config
    from rlhfkit.trainers.rm import collate_rm, rm_samples

    rows = [{"q": f"question {i}", "good": f"fine answer {i}", "bad": "no", "gap": 0.5 * i} for i in range(3)]
    cfg = parse_config("rm", GROUPS, ["--prompt_key", "q", "--chosen_key", "good", "--rejected_key", "bad",
                                      "--margin_loss", "--margin_key", "gap", "--input_template", "Q: {} A: "])
    samples, stats = rm_samples(cfg, tokenizer, rows)
    assert stats["kept"] == 3
    first = samples[1]
    assert tokenizer.decode(first["chosen_ids"]).startswith("Q: question 1 A: fine answer 1")
    assert "A: no" in tokenizer.decode(first["rejected_ids"])
    assert [s["margin"] for s in samples] == [0.0, 0.5, 1.0]  # --margin_key gap, read with --margin_loss
    assert collate_rm(samples, tokenizer.pad_token_id)["margin"].tolist() == [0.0, 0.5, 1.0]
    plain, _ = rm_samples(parse_config("rm", GROUPS, ["--prompt_key", "q", "--chosen_key", "good",
                                                      "--rejected_key", "bad"]), tokenizer, rows)
    assert "margin" not in plain[0]


def test_seed_decides_the_mix_and_the_epoch_order(tmp_path):
    from rlhfkit.cli.sft import GROUPS
    from rlhfkit.config.parse import parse_config
    from rlhfkit.trainers.common import load_split
    from rlhfkit.trainers.loop import epoch_order

    a = write_jsonl([{"input": f"a{i}", "output": "x"} for i in range(50)], tmp_path / "a.jsonl")
    b = write_jsonl([{"input": f"b{i}", "output": "y"} for i in range(50)], tmp_path / "b.jsonl")

    def mix(seed: str) -> list[str]:
        cfg = parse_config("sft", GROUPS, ["--dataset", f"{a},{b}", "--dataset_probs", "0.5,0.5", "--max_samples",
                                           "40", "--seed", seed])
        return [r["input"] for r in load_split(cfg, cfg.dataset, cfg.dataset_split, cfg.dataset_probs,
                                               cfg.max_samples)]

    assert mix("1") == mix("1") and mix("1") != mix("2")
    cfg = parse_config("sft", GROUPS, ["--seed", "3"])
    assert epoch_order(40, cfg.seed, 0) != epoch_order(40, 42, 0)  # the loop's order is epoch_order(n, --seed, epoch)


def test_sft_keys_template_and_max_len_shape_the_samples(tokenizer):
    from rlhfkit.cli.sft import GROUPS
    from rlhfkit.config.parse import parse_config
    from rlhfkit.trainers.sft import sft_samples

    rows = [{"question": "name a colour", "answer": "red " * 30}]
    argv = ["--input_key", "question", "--output_key", "answer", "--input_template", "Q: {} A: "]
    (sample,), _ = sft_samples(parse_config("sft", GROUPS, argv), tokenizer, rows)
    text = tokenizer.decode(sample["input_ids"])
    assert text.startswith("Q: name a colour A: red red")  # --input_key, --input_template, --output_key
    target = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
    assert target.startswith("red red") and "colour" not in target  # the loss is on --output_key's text
    (short,), stats = sft_samples(parse_config("sft", GROUPS, [*argv, "--max_len", "16"]), tokenizer, rows)
    assert len(short["input_ids"]) <= 16 < len(sample["input_ids"]) and stats["truncated"] == 1  # --max_len
