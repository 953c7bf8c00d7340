"""build_reward_source dispatch by spec, combine rules, config mapping."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rewards import sources
from rlhfkit.rewards.base import RewardOutput
from rlhfkit.rewards.remote import RemoteRewardClient
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.sources import (
    CombinedSource,
    RewardSpec,
    build_reward_source,
    combine,
    reward_source_from_config,
)


class FakeModel:
    def __init__(self, spec, **kwargs):
        self.name, self.kwargs = f"rm:{spec}", kwargs

    def __call__(self, queries, prompts=None, labels=None):
        r = torch.full((len(queries),), 2.0)
        return RewardOutput(r, r.clone(), {"rm_truncated": torch.zeros(len(queries))})


@pytest.fixture
def fake_models(monkeypatch):
    monkeypatch.setattr(sources, "RewardModelSource", FakeModel)


def test_dispatch_by_spec(tmp_path, fake_models):
    file = tmp_path / "rf.py"
    file.write_text("def reward_func(q, p, l):\n    return {'rewards': [1.0] * len(q)}\n")
    src = build_reward_source(["some/rm_dir", f"{file},builtin:exact", "http://127.0.0.1:1", "http://127.0.0.1:2"],
                              timeout=5, model_kwargs={"max_len": 8}, remote_kwargs={"retries": 0})
    assert isinstance(src, CombinedSource)
    kinds = [type(s) for s in src.sources]
    assert kinds == [FakeModel, RewardFuncSource, RewardFuncSource, RemoteRewardClient]
    assert src.sources[0].kwargs == {"max_len": 8} and src.sources[2].name == "builtin:exact"
    assert src.sources[3].urls == ["http://127.0.0.1:1/get_reward", "http://127.0.0.1:2/get_reward"]
    assert isinstance(build_reward_source("builtin:math"), RewardFuncSource)
    with pytest.raises(ValueError, match="no reward source"):
        build_reward_source(" , ")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        build_reward_source("missing.py")


def test_combined_source_mean_and_weights(tmp_path, fake_models):
    queries, prompts, labels = ["P 1", "P 2"], ["P", "P"], ["1", "3"]
    out = build_reward_source("model,builtin:exact")(queries, prompts, labels)
    assert out.rewards.tolist() == [1.5, 1.0]  # mean of rm (2, 2) and exact (1, 0)
    assert out.extra_logs["builtin:exact/reward"].tolist() == [1.0, 0.0]
    assert "rm:model/rm_truncated" in out.extra_logs and "builtin:exact/reward_failed" in out.extra_logs
    weighted = build_reward_source("model,builtin:exact", weights=[0.5, 2.0])(queries, prompts, labels)
    assert weighted.rewards.tolist() == [3.0, 1.0]
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        build_reward_source("model,builtin:exact", weights=[1.0])


def test_combine_rules_and_errors():
    a = RewardOutput(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), failed=1)
    b = RewardOutput(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0]), failed=2)
    out = combine([a, b], ["a", "b"], "sum")
    assert out.rewards.tolist() == [4.0, 6.0] and out.scores.tolist() == [1.0, 2.0] and out.failed == 3
    assert combine([a, b], ["a", "b"]).rewards.tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="reward_combine"):
        combine([a, b], ["a", "b"], "max")
    with pytest.raises(ValueError, match="different batch sizes"):
        combine([a, RewardOutput(torch.zeros(3), torch.zeros(3))], ["a", "c"])


def test_from_config(fake_models):
    cfg = RewardSpec(reward_pretrain="m1,m2", remote_rm_url=None, reward_combine="sum", max_len=64,
                     micro_rollout_batch_size=4, normalize_reward=True)
    src = reward_source_from_config(cfg)
    assert [s.name for s in src.sources] == ["rm:m1", "rm:m2"] and src.rule == "sum"
    assert src.sources[0].kwargs == {"normalize_reward": True, "max_len": 64, "micro_batch_size": 4}
    single = reward_source_from_config(RewardSpec(remote_rm_url="builtin:format", reward_timeout=3))
    assert single.name == "builtin:format" and single.timeout == 3


def test_from_config_passes_the_remote_and_model_settings():
    cfg = RewardSpec(remote_rm_url="http://127.0.0.1:1", remote_rm_timeout=7, remote_rm_retries=5,
                     remote_rm_backoff=0.5, remote_rm_token="secret")
    client = reward_source_from_config(cfg)
    assert isinstance(client, RemoteRewardClient)
    assert (client.timeout, client.retries, client.backoff, client.token) == (7.0, 5, 0.5, "secret")
    assert client.urls == ["http://127.0.0.1:1/get_reward"]


def test_from_config_micro_batch_size_argument_wins(fake_models):
    cfg = RewardSpec(reward_pretrain="m", micro_rollout_batch_size=16)
    assert reward_source_from_config(cfg).kwargs["micro_batch_size"] == 16
    assert reward_source_from_config(cfg, micro_batch_size=2).kwargs["micro_batch_size"] == 2
    assert reward_source_from_config(RewardSpec(reward_pretrain="m")).kwargs == {
        "normalize_reward": False, "max_len": 2048, "micro_batch_size": 8}


def test_an_empty_batch_gives_empty_rewards():
    out = build_reward_source("builtin:exact")([], [], [])
    assert out.rewards.shape == (0,) and out.scores.shape == (0,) and len(out) == 0
