"""Context parallel (--ring_attn_size, --ring_head_stride): two real gloo processes, each holding half of every
sequence, give the loss and the gradients of the unsharded forward (fp32, atol 1e-5), for padded and packed batches,
a causal LM (SFT log-probs), a grouped-query-attention variant, a reward model's per-token head values and the KD
loss (student and teacher both split)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.data.collate import collate_packed
from rlhfkit.models import context_parallel as cp

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ring_worker.py")
ATOL = 1e-5


def run_two_ranks(tmp_path: Path, model_dir: str) -> list[dict]:
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": loopback, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(tmp_path / "store"), model_dir,
                               str(tmp_path / f"out{rank}.pt")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    return [torch.load(tmp_path / f"out{rank}.pt", weights_only=False) for rank in range(2)]


def test_ring_attention_over_two_ranks_equals_the_unsharded_forward(tmp_path, tiny_model_dir):
    ranks = run_two_ranks(tmp_path, tiny_model_dir)
    reference = ranks[0]["reference"]
    assert ranks[0]["ring_attn_size"] == 2  # each sequence split over the two ranks (lm, gqa, rm, kd)
    assert set(ranks[0]["ring"]) == {(m, layout, s) for m, s in (("lm", 1), ("lm", 2), ("gqa", 1), ("rm", 1),
                                                                 ("kd", 1)) for layout in ("padded", "packed")}
    for (model, layout, stride), got in ranks[0]["ring"].items():
        want = reference[(model, layout)]
        for rank in ranks:  # both ranks of the ring hold the whole loss
            torch.testing.assert_close(rank["ring"][(model, layout, stride)]["loss"], want["loss"], rtol=0, atol=ATOL)
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=ATOL, msg=f"{model} {layout} {name}")
        assert any(g.abs().max() > 1e-3 for g in want["grads"].values())  # the comparison is not between zeros
    # packed and padded references agree, so the packed ring result is also the padded one
    torch.testing.assert_close(reference[("lm", "packed")]["loss"], reference[("lm", "padded")]["loss"], atol=ATOL,
                               rtol=0)
    assert "--ring_head_stride 3" in ranks[0]["bad_stride"] and "heads (2)" in ranks[0]["bad_stride"]


def test_ring_mask_follows_global_positions_padding_and_sequence_bounds():
    ring = cp.RingGroup(group=None, rank=1, size=2)
    # packed row: sequences of 3 and 2 tokens -> padded to 6 (the extra token is a sequence of its own)
    row = collate_packed([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    local = cp.shard_forward_kwargs({"input_ids": row["input_ids"], "position_ids": row["position_ids"]}, ring)
    assert local["input_ids"].tolist() == [[4, 5, 0]] and local["position_ids"].tolist() == [[0, 1, 0]]
    allowed = local["attention_mask"][0, 0].int().tolist()  # queries 3, 4, 5 over keys 0..5
    assert allowed == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    # padded batch: key padding hidden, causal by global index; a padding query sees itself only
    ids = torch.tensor([[7, 8, 9, 6], [7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    local = cp.shard_forward_kwargs({"input_ids": ids, "position_ids": torch.arange(4).expand(2, 4),
                                     "attention_mask": mask}, ring)
    assert local["input_ids"].tolist() == [[9, 6], [0, 0]] and local["position_ids"].tolist() == [[2, 3], [2, 3]]
    assert local["attention_mask"][:, 0].int().tolist() == [[[1, 1, 1, 0], [1, 1, 1, 1]],
                                                            [[1, 1, 1, 0], [1, 1, 0, 1]]]


def test_ring_size_must_divide_the_world_size(monkeypatch):
    monkeypatch.setattr(cp.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cp.dist, "get_world_size", lambda: 3)
    with pytest.raises(Exception, match="--ring_attn_size 2 must divide the world size 3"):
        cp.setup_ring_attention(2)
    assert cp.setup_ring_attention(1) is None and cp.ring_group() is None
    with pytest.raises(Exception, match="--ring_head_stride"):
        cp.setup_ring_attention(2, head_stride=0)
    with pytest.raises(Exception, match="--ring_head_stride 2 acts only with --ring_attn_size > 1"):
        cp.setup_ring_attention(1, head_stride=2)
    from types import SimpleNamespace

    from rlhfkit.trainers.common import setup_context_parallel

    with pytest.raises(Exception, match="--aux_loss_coef with --ring_attn_size 2"):  # router loss is per sequence
        setup_context_parallel(SimpleNamespace(ring_attn_size=2, ring_head_stride=1, aux_loss_coef=0.01))


@pytest.mark.parametrize("command", ["prm"])
def test_commands_without_context_parallel_refuse_the_ring_flags(command):
    import importlib

    from rlhfkit.config.parse import parse_config
    from rlhfkit.errors import ConfigError

    groups = importlib.import_module(f"rlhfkit.cli.{command}").GROUPS
    for argv in (["--ring_attn_size", "2"], ["--ring_head_stride", "2"]):
        with pytest.raises(ConfigError, match=f"{argv[0]} is not supported by 'rlhfkit {command}'.*not for {command}"):
            parse_config(command, groups, argv)
    from rlhfkit.cli.sft import GROUPS

    cfg = parse_config("sft", GROUPS, ["--ring_attn_size", "2", "--ring_head_stride", "2"])
    assert (cfg.ring_attn_size, cfg.ring_head_stride) == (2, 2)
