"""Tensor parallel training (--ds_tensor_parallel_size, alias --tp_size): four real gloo processes (2 data parallel x
2 tensor parallel, FSDP2 on the data-parallel dimension), each holding half of every attention/MLP weight and half
of the vocabulary, give the unsharded step (fp32): the loss, every parameter
gradient, the clipped gradient norm and the weights after one AdamW step, for a tiny Llama (tied embeddings), a tiny
Qwen2 (grouped-query attention, q/k/v biases, untied LM head) and a Llama reward model; the checkpoint state dict is
whole. Plus the refusals (heads not divisible, model family, world size, commands and flags that do not compose)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.config.parse import parse_config
from rlhfkit.errors import ConfigError
from rlhfkit.models import tensor_parallel as tp

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
LOSS_ATOL, GRAD_ATOL, NORM_RTOL = 1e-5, 1e-6, 1e-4
WEIGHT_ATOL = 5e-5  # 0.5% of the lr: a wrong or missing AdamW update moves a weight by ~lr (1e-2)


def run_ranks(tmp_path: Path, model_dir: str, world: int, size: int) -> list[dict]:
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": loopback, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), str(size), str(tmp_path / "store"),
                               model_dir, str(tmp_path / f"out{rank}.pt")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    return [torch.load(tmp_path / f"out{rank}.pt", weights_only=False) for rank in range(world)]


def test_tp_2_by_dp_2_equals_the_unsharded_step(tmp_path, tiny_model_dir):
    # --ds_tensor_parallel_size 2 on 4 ranks: 2 data-parallel groups (FSDP2 on the "dp" dimension of the 2-D mesh),
    # each on half of the batch; the 1 x 2 layout without FSDP2 is tests/e2e/test_tensor_parallel.py's
    ranks = run_ranks(tmp_path, tiny_model_dir, world=4, size=2)
    reference = ranks[0]["reference"]
    assert set(reference) == {"llama", "qwen2", "rm"}
    for name, want in reference.items():
        for rank in ranks:
            got = rank["tp"][name]
            assert got["group"] == 2
            torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=LOSS_ATOL)
            assert got["norm"] == pytest.approx(want["norm"], rel=NORM_RTOL)
            assert want["norm"] > 0.5  # clipping (max_norm 0.5) acted, so the norm's scale reached the update
            assert set(got["grads"]) == set(want["grads"])
            for param, grad in want["grads"].items():
                torch.testing.assert_close(got["grads"][param], grad, rtol=0, atol=GRAD_ATOL, msg=f"{name} {param}")
                torch.testing.assert_close(got["weights"][param], want["weights"][param], rtol=0, atol=WEIGHT_ATOL,
                                           msg=f"{name} {param} after the step")
        assert any(g.abs().max() > 1e-3 for g in want["grads"].values())  # the comparison is not between zeros
        state = ranks[0]["tp"][name]["state"]  # what a saved HF folder receives: whole, plain tensors
        for param, weight in want["weights"].items():
            assert type(state[param]) is torch.Tensor and state[param].shape == weight.shape
            torch.testing.assert_close(state[param], weight, rtol=0, atol=WEIGHT_ATOL)


def _model(model_type: str = "llama", heads: int = 4, kv_heads: int = 2, inter: int = 256, vocab: int = 128):
    config = SimpleNamespace(model_type=model_type, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             intermediate_size=inter, vocab_size=vocab)
    return SimpleNamespace(config=config)


def test_tp_size_must_divide_heads_world_and_fit_the_family(monkeypatch):
    tp.check_model(_model(), 2)
    with pytest.raises(ConfigError, match="--ds_tensor_parallel_size 4 must divide the model's num_key_value_heads"):
        tp.check_model(_model(), 4)
    with pytest.raises(ConfigError, match="--ds_tensor_parallel_size 2 must divide the model's num_attention_heads"):
        tp.check_model(_model(heads=3, kv_heads=3), 2)
    with pytest.raises(ConfigError, match="Llama/Qwen family .* not model_type 'gpt2'"):
        tp.check_model(_model("gpt2"), 2)
    monkeypatch.setattr(tp.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tp.dist, "get_world_size", lambda: 3)
    with pytest.raises(ConfigError, match="--ds_tensor_parallel_size 2 must divide the world size 3"):
        tp.setup_tensor_parallel(2)
    with pytest.raises(ConfigError, match="must be >= 1"):
        tp.setup_tensor_parallel(0)
    assert tp.setup_tensor_parallel(1) is None and tp.tp_group() is None and tp.tp_size() == 1


def _groups(command: str) -> list:
    import importlib

    return importlib.import_module(f"rlhfkit.cli.{command.replace('-', '_')}").GROUPS


@pytest.mark.parametrize("argv", [["--tp_size", "2"], ["--ds_tensor_parallel_size", "2"],
                                  ["--ds.tensor_parallel_size", "2"]])
def test_tp_flag_names_on_the_training_commands(argv, tmp_path):
    for command in ("sft", "rm", "dpo", "kto"):
        assert parse_config(command, _groups(command), argv).ds_tensor_parallel_size == 2
    config = tmp_path / "run.yaml"
    config.write_text("tp_size: 2\n")
    assert parse_config("sft", _groups("sft"), ["--config", str(config)]).ds_tensor_parallel_size == 2
    # batch-inference keeps --tp_size for its vLLM engines
    assert parse_config("batch-inference", _groups("batch-inference"), ["--tp_size", "2"]).tp_size == 2


@pytest.mark.parametrize("command", ["ppo", "kd", "prm"])
def test_commands_without_tensor_parallel_refuse_the_flags(command):
    for argv in (["--tp_size", "2"], ["--ds_tensor_parallel_size", "2"], ["--ds.tensor_parallel_size", "2"]):
        with pytest.raises(ConfigError, match=f"tensor parallel training is implemented for sft, rm, dpo and kto, "
                                              f"not for {command}"):
            parse_config(command, _groups(command), argv)


@pytest.mark.parametrize("extra, message", [({"ring_attn_size": 2}, "do not compose yet"),
                                            ({"lora_rank": 4}, "LoRA adapters wrap the linear layers")])
def test_tp_with_ring_attention_or_lora_is_refused(extra, message):
    from rlhfkit.trainers.common import setup_tp

    cfg = SimpleNamespace(**{"ds_tensor_parallel_size": 2, "ring_attn_size": 1, "lora_rank": 0, **extra})
    info = SimpleNamespace(device=torch.device("cpu"), world_size=2)
    with pytest.raises(ConfigError, match=f"--ds_tensor_parallel_size 2 with .*{message}"):
        setup_tp(cfg, info)
