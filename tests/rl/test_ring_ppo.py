"""Context parallel in ppo (--ring_attn_size): the actor, reference and critic workers on two real gloo ranks, each
holding half of every sequence, give the unsharded workers' log-probs, values, losses and gradients (fp32, atol 1e-5),
padded and packed (and, unsharded, packed equals padded, a reward model's scores included); the driver hands a ring
group's ranks the rows of one data-parallel rank; and one ppo step with the actor's two ranks in one ring group equals
the 1-rank step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError
from rlhfkit.rl.ring import rank_rows

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ring_ppo_worker.py")
ATOL = 1e-5


def run_ranks(tmp_path: Path, world: int, model_dir: str, reward_dir: str, flags: dict) -> list[subprocess.Popen]:
    """`world` ranks of ring_ppo_worker.py, the ppo `flags` (ring size, head stride) as a JSON argument."""
    from rlhfkit.engine.distributed import free_port

    loopback = "lo0" if sys.platform == "darwin" else "lo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": loopback, "PYTHONPATH": str(REPO)}
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), port, model_dir, reward_dir,
                              str(tmp_path / f"w{world}_rank{rank}.pt"), json.dumps(flags)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]


@pytest.mark.parametrize("sampling", [
    pytest.param({}, id="whole-softmax"),
    # the trainer's top-k / top-p log-probs (--logprobs_truncation auto) through both ring layouts
    pytest.param({"top_k": 20, "top_p": 0.9}, id="top-k-top-p", marks=pytest.mark.slow),
])
def test_ring_workers_equal_the_unsharded_workers(tmp_path, tiny_model_dir, tiny_reward_model_dir, sampling):
    # the ring flags as ppo parses them (the ranks build their workers from these values)
    cfg = ppo_cfg("--ring_attn_size", "2", "--ring_head_stride", "2")
    ring_flags = {"ring_attn_size": cfg.ring_attn_size, "ring_head_stride": cfg.ring_head_stride}
    procs = run_ranks(tmp_path, 1, tiny_model_dir, tiny_reward_model_dir, sampling) + \
        run_ranks(tmp_path, 2, tiny_model_dir, tiny_reward_model_dir, {**ring_flags, **sampling})
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    [want] = [torch.load(tmp_path / "w1_rank0.pt", weights_only=False)]
    ranks = [torch.load(tmp_path / f"w2_rank{r}.pt", weights_only=False) for r in range(2)]
    assert want["ring"] == [1, 1, 1] and ranks[0]["ring"] == [2, 2, 2]
    # --ring_head_stride 2: the tiny model's 2 key/value heads travel in one all-gather per layer (stride 1: two
    # messages of 1 head); same result either way (below), so the layout of the messages is the flag's effect
    assert want["kv_heads_per_gather"] == [] and all(r["kv_heads_per_gather"] == [2] for r in ranks)
    # a critic started from the causal LM gets the same fresh value head on 1 rank and on 2 (seeded alike, not
    # seed + rank: FSDP2 would keep each rank's own chunk of its own draw)
    assert torch.equal(ranks[0]["fresh_head"], want["fresh_head"]) and torch.equal(ranks[1]["fresh_head"],
                                                                                 want["fresh_head"])
    close = dict(rtol=0, atol=ATOL)
    for layout in ("padded", "packed"):
        ref = want[layout]
        for got in (r[layout] for r in ranks):  # every rank of the ring group holds the whole result
            mask = got["action_mask"]  # past a row's response the padded outputs are of padding, never used
            for key in ("log_probs", "ref_log_probs", "values"):
                torch.testing.assert_close(got[key] * mask, ref[key] * mask, **close, msg=f"{layout} {key}")
            torch.testing.assert_close(got["probe"], ref["probe"], **close)
            for step, norm in (("policy", "grad_norm"), ("critic", "critic_grad_norm")):
                assert got[step][norm] == pytest.approx(ref[step][norm], rel=1e-4), (layout, step)
            for side in ("actor_grads", "critic_grads"):
                assert got[side].keys() == ref[side].keys()
                for name, grad in ref[side].items():
                    torch.testing.assert_close(got[side][name], grad, **close, msg=f"{layout} {side} {name}")
        assert any(g.abs().max() > 1e-3 for g in ref["actor_grads"].values())  # not a comparison of zeros
        assert any(g.abs().max() > 1e-3 for g in ref["critic_grads"].values())
        first, second = ranks[0][layout], ranks[1][layout]
        for step in ("policy", "critic"):  # the group's first rank reports the sums, once
            assert first[step].keys() == ref[step].keys()
            for key, value in ref[step].items():
                if key == "value_clip_frac":  # |v - old| < clip: the two branches tie, rounding picks one
                    continue
                assert first[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (layout, step, key)
            assert set(second[step]) == {k for k in ref[step] if k.endswith(("grad_norm", "lr"))}
    assert {"policy_loss", "kl_loss", "entropy"} <= want["padded"]["policy"].keys()
    assert "critic_loss" in want["padded"]["critic"]
    assert_packed_equals_padded(want["packed"], want["padded"])


def assert_packed_equals_padded(packed: dict, padded: dict) -> None:
    """--packing_samples in the real workers (one rank): the actor's and reference's log-probs, the critic's values,
    the reward model's scores, the policy step (with its k3 KL loss) and the value step, metrics and gradients, equal
    the padded layout's; float32 up to summation order (a shared prompt token sums its responses' gradients in
    another order: rtol 1e-4, atol 1e-4 x the tensor's largest entry), log-probs and values atol 2e-5 as in
    test_packing.py. (This replaces a second, padded, end-to-end ppo run of all four roles in test_packing.py.)"""
    mask = padded["action_mask"]
    for key in ("log_probs", "ref_log_probs", "values"):
        assert (padded[key] * mask).abs().sum() > 0.1, key  # a real comparison, not zeros against zeros
        torch.testing.assert_close(packed[key] * mask, padded[key] * mask, rtol=0, atol=2e-5, msg=key)
    assert padded["rewards"].std() > 0
    torch.testing.assert_close(packed["rewards"], padded["rewards"], rtol=0, atol=2e-5)
    for step in ("policy", "critic"):
        assert packed[step].keys() == padded[step].keys(), step
        for key, value in padded[step].items():
            if key == "value_clip_frac":  # |v - old| < clip: the two branches tie, rounding picks one
                continue
            assert packed[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    for side in ("actor_grads", "critic_grads"):
        assert packed[side].keys() == padded[side].keys() and len(padded[side]) > 10
        for name, grad in padded[side].items():
            torch.testing.assert_close(packed[side][name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                       msg=lambda m, n=f"{side} {name}": f"{n}: {m}")


def test_a_ring_group_takes_the_rows_of_one_data_parallel_rank():
    assert rank_rows(5, 4, 2) == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]   # dp 2 x ring 2
    assert rank_rows(5, 2, 2) == [[0, 1, 2, 3, 4]] * 2                    # one ring group: everything twice
    assert rank_rows(5, 2, 1) == [[0, 1, 2], [3, 4]]                      # plain data parallel


def ppo_cfg(*argv: str):
    base = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format"}
    return parse_config("ppo", GROUPS, flags_to_argv(base) + list(argv))


def test_ppo_ring_flags_are_checked_against_the_roles():
    from rlhfkit.rl.validate import validate_rl

    cfg = ppo_cfg("--ds.ring_attn_size", "2", *(f"--{role}_num_gpus_per_node=2" for role in ("actor", "ref", "critic")))
    assert cfg.ring_attn_size == 2  # OpenRLHF's dotted name maps onto the flag
    validate_rl(cfg)
    with pytest.raises(ConfigError, match="--ring_attn_size 2 must divide the actor's 1 ranks"):
        validate_rl(ppo_cfg("--ring_attn_size", "2", "--init_kl_coef", "0"))
    with pytest.raises(ConfigError, match="must divide the ref's 1 ranks .*--ref_num_gpus_per_node"):  # KL: reference
        validate_rl(ppo_cfg("--ring_attn_size", "2", "--actor_num_gpus_per_node", "2"))
    with pytest.raises(ConfigError, match="must divide the critic's 1 ranks"):  # gae: the critic is split too
        validate_rl(ppo_cfg("--ring_attn_size", "2", "--actor_num_gpus_per_node", "2", "--advantage_estimator", "gae",
                            "--init_kl_coef", "0"))
    with pytest.raises(ConfigError, match="--ring_head_stride 2 acts only with --ring_attn_size > 1"):
        validate_rl(ppo_cfg("--ring_head_stride", "2"))
    with pytest.raises(ConfigError, match="--pretrain_data .* with --ring_attn_size 2"):
        validate_rl(ppo_cfg("--ring_attn_size", "2", "--actor_num_gpus_per_node", "2", "--pretrain_data", "d",
                            "--ptx_coef", "0.1", "--init_kl_coef", "0", "--critic_num_gpus_per_node", "2"))


@pytest.mark.slow
def test_a_ppo_step_with_ring_attn_size_2_equals_one_rank(grpo_one_step, tiny_model_dir, echo_prompt_file,
                                                          rollout_vllm_engine, tmp_path):
    """One step on 1 actor rank (the session's `grpo_one_step`, tests/rl/conftest.py) and on 2 actor ranks forming
    one ring group (each sequence split in two) gives the same update: every metric and the saved weights
    (tests/rl/ppo_helpers.assert_same_step)."""
    from ppo_helpers import assert_same_step, run

    one_out, one = grpo_one_step
    two = run(tiny_model_dir, echo_prompt_file, tmp_path / "two", rollout_vllm_engine, max_samples=4,
              actor_num_gpus_per_node=2, ring_attn_size=2)
    assert_same_step(one, two, one_out, tmp_path / "two", tiny_model_dir)
