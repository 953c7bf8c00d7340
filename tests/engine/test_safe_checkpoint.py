"""Safe checkpoints (#29): a crafted checkpoint file never runs code at --load_checkpoint, and the state rlhfkit
writes (scheduler, RNG, the rollouts an --async_train run generated ahead) round-trips exactly without pickle."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.engine import checkpoint
from rlhfkit.engine.checkpoint import load_checkpoint, rng_state, save_checkpoint
from rlhfkit.engine.safe_state import UnsafeCheckpointError, convert_trusted, load_state, save_state
from rlhfkit.rl import async_rollout
from rlhfkit.rl.make_experience import Rollout, Timer
from rlhfkit.rollout.types import RolloutSample

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group


class _Payload:
    """Unpickling it writes the marker file: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def _saved(tmp_path: Path, monkeypatch, parts: tuple) -> tuple[Path, tuple]:
    monkeypatch.setattr(checkpoint, "_rank", lambda: 0)
    monkeypatch.setattr(checkpoint, "_world_size", lambda: 1)
    model, optimizer, scheduler = parts
    save_checkpoint(tmp_path / "ckpt", 3, model, optimizer, scheduler, {"epoch": 0}, max_keep=1)
    return tmp_path / "ckpt" / "global_step3", parts


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_rank0.pt"])
def test_a_crafted_scheduler_or_rng_file_is_refused_and_runs_nothing(tmp_path, monkeypatch, name, stepped_linear):
    folder, (model, optimizer, scheduler) = _saved(tmp_path, monkeypatch, stepped_linear)
    marker = tmp_path / "marker"
    torch.save({"last_epoch": 1, "x": _Payload(marker)}, folder / name)
    with pytest.raises(UnsafeCheckpointError, match=rf"{name}: refused to load .*convert_trusted"):
        load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler)
    assert not marker.exists()


def test_a_crafted_async_rollout_file_is_refused_and_runs_nothing(tmp_path):
    cfg = PPOConfig(ckpt_path=str(tmp_path / "ckpt"))
    path = async_rollout.pending_path(cfg, 2)
    path.parent.mkdir(parents=True)
    marker = tmp_path / "marker"
    torch.save([(_Payload(marker), {}, None)], path)
    with pytest.raises(UnsafeCheckpointError, match=r"pending_rollout_step2.pt: refused to load the rollouts"):
        async_rollout.load_pending(cfg, 2)
    assert not marker.exists()


def test_old_pickled_rng_files_are_refused_and_can_be_converted_when_trusted(tmp_path, monkeypatch, stepped_linear):
    folder, (model, optimizer, scheduler) = _saved(tmp_path, monkeypatch, stepped_linear)
    random.seed(4)
    np.random.seed(4)
    torch.manual_seed(4)
    old = rng_state()
    torch.save(old, folder / "rng_rank0.pt")  # the format before #29: pickled (numpy array inside)
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")  # plain data: still read
    with pytest.raises(UnsafeCheckpointError, match="rng_rank0.pt: refused to load rank 0's RNG state"):
        load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler)
    convert_trusted(folder / "rng_rank0.pt")
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.setstate(old["python"])
    np.random.set_state(old["numpy"])
    torch.set_rng_state(old["torch"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_rng_and_scheduler_state_round_trip_exactly(tmp_path, monkeypatch, stepped_linear):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    random.random(), np.random.rand(3), torch.rand(2)
    state = rng_state()
    save_state(state, tmp_path / "rng.pt")
    back = load_state(tmp_path / "rng.pt", "rng")
    assert back["python"] == state["python"] and isinstance(back["python"], tuple)
    assert back["numpy"][0] == state["numpy"][0] and back["numpy"][2:] == state["numpy"][2:]
    assert back["numpy"][1].dtype == state["numpy"][1].dtype and (back["numpy"][1] == state["numpy"][1]).all()
    assert torch.equal(back["torch"], state["torch"])
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    torch.set_rng_state(back["torch"])
    after = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    assert after == (random.random(), float(np.random.rand()), float(torch.rand(1)))

    _, _, scheduler = stepped_linear
    scheduler.step()
    save_state(scheduler.state_dict(), tmp_path / "scheduler.pt")
    assert load_state(tmp_path / "scheduler.pt", "scheduler") == scheduler.state_dict()


def test_async_rollouts_round_trip_exactly(tmp_path):
    cfg = PPOConfig(ckpt_path=str(tmp_path / "ckpt"), max_ckpt_num=2)
    sample = RolloutSample(0, 1, [1, 2], [3, 4], [-0.5, -0.25], "stop", extra={"policy_versions": [0, 1], "turns": 2},
                           action_mask=[True, False])
    rollout = Rollout(prompts=[{"prompt": "p", "prompt_ids": [1, 2], "label": None, "__rlhfkit_x__": {1, 2}}],
                      samples=[sample], rewards=torch.tensor([1.0]), scores=torch.tensor([0.5]), texts=["t"],
                      reward_failed=1, extra_logs={"r": torch.tensor([2.0]), "n": np.float32(1.5),
                                                   "a": np.arange(3, dtype=np.uint32)},
                      reward_failure=[""], reward_failures={"error": 1})
    collected = [(rollout, {"m": 1.0, "k": (1, "x")}, Timer({"generation": 0.25}))]
    async_rollout.save_pending(cfg, 1, collected)
    [(back, metrics, timer)] = async_rollout.load_pending(cfg, 1)
    assert metrics == {"m": 1.0, "k": (1, "x")} and timer == Timer({"generation": 0.25})
    assert back.samples == [sample] and back.prompts == rollout.prompts and back.texts == ["t"]
    assert torch.equal(back.rewards, rollout.rewards) and torch.equal(back.scores, rollout.scores)
    assert back.reward_failed == 1 and back.reward_failure == [""] and back.reward_failures == {"error": 1}
    logs = back.extra_logs
    assert torch.equal(logs["r"], torch.tensor([2.0]))
    assert logs["n"] == np.float32(1.5) and type(logs["n"]) is np.float32
    assert logs["a"].dtype == np.uint32 and logs["a"].tolist() == [0, 1, 2]


def test_saving_an_unknown_object_fails_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"x.pt\['f'\]: a .*_Payload cannot be saved"):
        save_state({"f": _Payload(tmp_path / "m")}, tmp_path / "x.pt")


def test_a_crafted_dcp_metadata_file_is_refused_and_runs_nothing(tmp_path, monkeypatch, stepped_linear):
    """DCP reads `.metadata` with plain `pickle.load`; rlhfkit reads it with a restricted unpickler."""
    folder, (model, optimizer, scheduler) = _saved(tmp_path, monkeypatch, stepped_linear)
    load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler)  # the real metadata passes
    marker = tmp_path / "marker"
    (folder / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"model/\.metadata: refused to load the torch\.distributed"):
        load_checkpoint(tmp_path / "ckpt", model, optimizer, scheduler)
    assert not marker.exists()
