"""ppo's model-loading and forward flags reach a real model worker (rlhfkit.rl.worker.ModelWorker, run in this process
on a 1-rank gloo group, `init_model` as the driver calls it), built from ppo's parsed command line:
--attn_implementation (the kernel every role's model loads with) and --packing_samples (one packed row per
micro-batch, each shared prompt computed once, the padded forward's log-probs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.rl.experience import build_experience

BASE = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format"}
# three prompts, the first shared by three samples and the second by two (one of them an empty response)
PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [11, 12], [13, 14, 15]]
RESPONSES = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [], [31, 32, 33, 34]]


def ppo_cfg(**flags):
    return parse_config("ppo", None, flags_to_argv({**BASE, **flags}))


@pytest.fixture
def worker(monkeypatch):
    """make(cfg, role) -> a ModelWorker of `role` built from `cfg` (its model not loaded yet)."""
    from rlhfkit.engine.distributed import free_port
    from rlhfkit.rl.worker import ModelWorker

    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)  # the worker sets these as Ray's would; restored after the test
    owned = not dist.is_initialized()

    def make(cfg, role: str):
        values = dataclasses.replace(cfg, torch_threads_per_worker=torch.get_num_threads())
        return ModelWorker(role, values, 0, 1, "127.0.0.1", port)

    yield make
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def test_attn_implementation_is_the_kernel_of_every_role(worker, tiny_model_dir):
    """--attn_implementation eager: the actor (trainable), the reference (frozen) and the critic (a fresh scalar
    head) load with the eager kernel; without the flag they load with sdpa."""
    for flags, want in (({"attn_implementation": "eager"}, "eager"), ({}, "sdpa")):
        cfg = ppo_cfg(**flags)
        for role, trainable, scalar in (("actor", True, False), ("ref", False, False), ("critic", True, True)):
            w = worker(cfg, role)
            w.init_model(tiny_model_dir, trainable, 10, 0.0, scalar)
            assert w.model.config._attn_implementation == want, (flags, role)


def test_packing_samples_forwards_one_packed_row_with_the_padded_log_probs(worker, tiny_model_dir):
    """--packing_samples: the actor's log-prob pass over a micro-batch of 6 samples runs the model once on one row of
    25 tokens (each of the 3 prompts once, then its responses: 5 + 9 + 2 + 2 + 3 + 4), not on 6 padded rows; the
    log-probs of the response tokens are the padded forward's (float32, up to summation order)."""
    batch = build_experience(PROMPTS, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], [0, 0, 0, 1, 1, 2],
                             0).tensors()
    valid = batch["action_mask"]
    results = []
    for flags in ({"packing_samples": True}, {}):
        w = worker(ppo_cfg(micro_rollout_batch_size=6, **flags), "actor")
        w.init_model(tiny_model_dir, True, 10, 0.0)
        assert w.forward.name == ("packed" if flags else "padded")  # picked once, at init_model (rl/forward.py)
        shapes: list[tuple[int, ...]] = []
        w.model.register_forward_pre_hook(lambda _m, args, kwargs, seen=shapes: seen.append(
            tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        log_probs = w.log_probs(batch)
        results.append((shapes, log_probs * valid))
    (packed_shapes, packed), (padded_shapes, padded) = results
    n_tokens = sum(map(len, {tuple(p) for p in PROMPTS})) + sum(map(len, RESPONSES))
    assert n_tokens == 25
    assert packed_shapes == [(1, n_tokens)]
    assert len(padded_shapes) == 1 and padded_shapes[0][0] == len(PROMPTS)  # 6 padded rows
    assert packed.abs().sum() > 1.0  # a real comparison, not zeros against zeros
    torch.testing.assert_close(packed, padded, rtol=0, atol=2e-5)
