"""The data, schedule, placement, rollout-engine and evaluation flags of `rlhfkit ppo` act: `build_setup` is run up
to the creation of the model groups (no Ray: its placement groups are recorded instead), and the engine options and
the evaluation's sampling are checked on what they build."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rlhfkit.rl.placement as placement
import rlhfkit.rl.setup as setup
from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.config.plan import resolve_plan
from rlhfkit.data.synthetic import write_jsonl

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


class Reached(Exception):
    pass


def ppo_cfg(**flags):
    return parse_config("ppo", GROUPS, flags_to_argv(flags))


def _run_setup(monkeypatch, cfg) -> dict:
    seen: dict = {"placement": []}
    monkeypatch.setattr(setup, "start_ray", lambda cfg: False)
    monkeypatch.setattr(setup, "preflight", lambda cfg, engines=None: None)  # tests/rl/test_preflight.py
    monkeypatch.setattr(setup, "cluster_has_gpus", lambda: False)
    monkeypatch.setattr(placement, "make_placement_group",
                        lambda nodes, per_node, cpus: seen["placement"].append((nodes, per_node)) or object())
    real_prompts, real_ptx = setup.load_prompts, setup.load_ptx

    def prompts(cfg, tokenizer, spec, split, probs=None, model_path=None):
        out = real_prompts(cfg, tokenizer, spec, split, probs, model_path)
        seen.setdefault("prompts", []).append(out)
        seen["tokenizer"] = tokenizer
        return out

    monkeypatch.setattr(setup, "load_prompts", prompts)
    monkeypatch.setattr(setup, "load_ptx", lambda cfg, tok: seen.setdefault("ptx", real_ptx(cfg, tok)))

    def groups(cfg, plan, updates, reward_specs, placement, made, critic_specs=None):
        seen.update(updates=updates, roles=sorted(placement.groups), reward_specs=list(reward_specs))
        raise Reached

    monkeypatch.setattr(setup, "_groups", groups)
    monkeypatch.setattr(setup, "_abandon", lambda *args: None)
    with pytest.raises(Reached):
        setup.build_setup(cfg)
    return seen


@pytest.fixture
def data(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"q": f"question {i}", "gold": str(i)} for i in range(28)]
    prompts = tmp_path / "prompts"
    DatasetDict({"train": Dataset.from_list(rows[:8]), "held": Dataset.from_list(rows[8:24]),
                 "eval": Dataset.from_list(rows[24:])}).save_to_disk(prompts)
    other = write_jsonl([{"q": f"other {i}", "gold": "x"} for i in range(40)], tmp_path / "other.jsonl")
    ptx = tmp_path / "ptx"
    ptx_rows = [{"text": f"pretraining text {i}", "answer": f"yes {i}"} for i in range(6)]
    DatasetDict({"train": Dataset.from_list(ptx_rows[:2]), "extra": Dataset.from_list(ptx_rows)}).save_to_disk(ptx)
    return str(prompts), other, str(ptx)


def test_data_schedule_and_placement_flags_of_build_setup(tiny_model_dir, data, tmp_path, monkeypatch):
    prompts, other, ptx = data
    cfg = ppo_cfg(pretrain=tiny_model_dir, prompt_data=f"{prompts},{other}", prompt_data_probs="1.0,0.0",
                  prompt_split="held", max_samples=12, eval_dataset=prompts, eval_split="eval", input_key="q",
                  label_key="gold", input_template="Q: {} A:", prompt_max_len=64, tokenizer_chat_template=TEMPLATE,
                  pretrain_data=f"{ptx},{ptx}", pretrain_data_probs="0.5,0.5", pretrain_split="extra",
                  pretrain_input_key="text", pretrain_output_key="answer", ptx_coef=0.1,
                  remote_rm_url="builtin:exact", advantage_estimator="gae", init_kl_coef=0.01,
                  rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=4, max_epochs=2, num_episodes=3,
                  actor_num_nodes=2, actor_num_gpus_per_node=2, ref_num_nodes=3, ref_num_gpus_per_node=3,
                  critic_num_nodes=2, critic_num_gpus_per_node=2, run_dir=str(tmp_path / "run"))
    seen = _run_setup(monkeypatch, cfg)
    train, held = seen["prompts"]
    # --prompt_data mixed by --prompt_data_probs (all from the first), --prompt_split held, cut by --max_samples;
    # --input_key / --label_key / --input_template
    assert len(train) == 12 and all(p["prompt"].startswith("Q: question ") for p in train)
    assert {int(p["label"]) for p in train} <= set(range(8, 24))
    # --eval_dataset with --eval_split eval: that split's 4 rows (not those of train, the default split)
    assert sorted(int(p["label"]) for p in held) == list(range(24, 28))
    assert seen["tokenizer"].chat_template == TEMPLATE
    # --pretrain_data (twice, --pretrain_data_probs), --pretrain_split extra, --pretrain_input_key text,
    # --pretrain_output_key answer: response-only loss on 'yes i'
    ptx_samples = seen["ptx"].samples
    assert len(ptx_samples) == 12  # max_samples cuts the blend
    tok = seen["tokenizer"]
    first = ptx_samples[0]
    target = tok.decode([t for t, m in zip(first["input_ids"], first["loss_mask"]) if m])
    assert target.startswith("yes ") and "pretraining" not in target
    # steps = 12 prompts / 4 per step x 3 episodes = 9; updates = 9 x 2 epochs x (4 x 2 / 4) mini-batches
    assert seen["updates"] == 9 * 2 * 2
    # one placement group per role: (nodes, ranks per node) from the --*_num_nodes / --*_num_gpus_per_node flags
    assert seen["roles"] == ["actor", "critic", "ref"]
    assert seen["placement"] == [(2, 2), (3, 3), (2, 2)]
    assert (tmp_path / "run" / "manifest.json").is_file()  # --run_dir


def test_reward_group_placement_flags(tiny_model_dir, tiny_reward_model_dir, data, tmp_path, monkeypatch):
    prompts, _, _ = data
    cfg = ppo_cfg(pretrain=tiny_model_dir, prompt_data=prompts, input_key="q", reward_pretrain=tiny_reward_model_dir,
                  advantage_estimator="reinforce", init_kl_coef=0, rollout_batch_size=4, train_batch_size=4,
                  reward_num_nodes=2, reward_num_gpus_per_node=3, run_dir=str(tmp_path / "run"))
    seen = _run_setup(monkeypatch, cfg)
    assert seen["roles"] == ["actor", "reward0"] and seen["placement"] == [(1, 1), (2, 3)]
    assert seen["reward_specs"] == [tiny_reward_model_dir]  # --reward_pretrain: the model its group loads


def test_engine_options_from_the_rollout_flags():
    from rlhfkit.launch.engine_spec import vllm_engine_spec

    cfg = ppo_cfg(vllm_tensor_parallel_size=2, vllm_gpu_memory_utilization=0.4, vllm_kv_cache_mb=32,
                  enforce_eager=True, enable_prefix_caching=True, prompt_max_len=50, generate_max_len=14,
                  vllm_dtype="bf16", seed=4)
    opts = vllm_engine_spec(cfg, dtype=cfg.vllm_dtype, seed=cfg.seed).kwargs()
    assert opts == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.4, "cpu_kv_cache_bytes": 32 << 20,
                    "enforce_eager": True, "enable_prefix_caching": True, "max_model_len": 64, "dtype": "bfloat16",
                    "seed": 4}


def test_eval_flags_set_the_evaluation_sampling(monkeypatch):
    import rlhfkit.rl.evaluation as trainer

    cfg = ppo_cfg(eval_temperature=0.3, eval_n_samples_per_prompt=3, generate_max_len=11, seed=2)
    seen = {}

    def fake_generate(engines, prompts, sampling, *args):
        seen["sampling"] = sampling
        return SimpleNamespace(scores=torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), rewards=torch.zeros(6))

    monkeypatch.setattr(trainer, "generate_and_score", fake_generate)
    monkeypatch.setattr(trainer, "_write_samples", lambda *a, **k: None)
    s = SimpleNamespace(cfg=cfg, stop_ids=[0], engines=[], eval_prompts=[{}, {}], reward_fn=None, tokenizer=None,
                        phases=None, agent=None)
    out = trainer.evaluate(s, 0)
    sampling = seen["sampling"]
    assert (sampling.temperature, sampling.n, sampling.max_new_tokens) == (0.3, 3, 11)
    # pass@k for k = 1 and --eval_n_samples_per_prompt; prompt 0 has 1 of 3 right, prompt 1 none
    assert out["eval/pass@1"] == pytest.approx((1 / 3 + 0) / 2) and out["eval/pass@3"] == pytest.approx(0.5)


def test_dynamic_filtering_reward_range_picks_the_groups():
    from rlhfkit.rl.make_experience import keep_groups

    scores = torch.tensor([0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 1.0])  # group means 0, 0.5, 1, 0.5
    default = ppo_cfg(dynamic_filtering=True)
    assert keep_groups(scores, 2, *default.dynamic_filtering_reward_range) == [1, 3]
    wide = ppo_cfg(dynamic_filtering=True, dynamic_filtering_reward_range=[-0.5, 1.5])
    assert keep_groups(scores, 2, *wide.dynamic_filtering_reward_range) == [0, 1, 2, 3]
    high = ppo_cfg(dynamic_filtering=True, dynamic_filtering_reward_range=[0.6, 1.5])
    assert keep_groups(scores, 2, *high.dynamic_filtering_reward_range) == [2]


def test_reward_format_pattern_reaches_the_format_reward():
    from rlhfkit.rl.reward_group import text_sources

    texts = ["<answer>42</answer>", "ANSWER: 42"]
    default = text_sources(ppo_cfg(remote_rm_url="builtin:format"))[0]
    custom = text_sources(ppo_cfg(remote_rm_url="builtin:format", reward_format_pattern=r"^ANSWER: \d+$"))[0]
    assert default(texts, ["", ""], None).rewards.tolist() != custom(texts, ["", ""], None).rewards.tolist()
    assert custom(texts, ["", ""], None).rewards.tolist() == [0.0, 1.0]


def test_checkpoint_and_save_flags_direct_the_workers():
    """What the driver asks the actor and critic groups to write: --ckpt_path, --max_ckpt_num, --save_hf_ckpt,
    --save_path, --save_value_network."""
    calls = []

    class Group:
        def __init__(self, role):
            self.role = role

        def call(self, method, *args):  # a ModelWorker method, as ModelGroup.call takes it
            calls.append((self.role, method.__name__, *args))

    cfg = ppo_cfg(pretrain="base", ckpt_path="/c", max_ckpt_num=2, save_hf_ckpt=True, save_path="/out",
                  save_value_network=True)
    s = SimpleNamespace(cfg=cfg, plan=resolve_plan(cfg), actor=Group("actor"), critic=Group("critic"), ptx=None)
    setup.RLSetup.save_checkpoint(s, 4, 7)
    setup.save_final(s)
    state = {"cursor": 7, "ptx_cursor": 0}
    assert calls == [("actor", "save_checkpoint", "/c/actor", 4, state, 2),
                     ("critic", "save_checkpoint", "/c/critic", 4, state, 2),
                     ("actor", "save_hf", "/c/actor/global_step4/hf", "base"),
                     ("actor", "save_hf", "/out", "base"), ("critic", "save_hf", "/out_critic", "base")]
    calls.clear()
    plain = ppo_cfg(pretrain="base", ckpt_path="/c", save_path="/out")
    s = SimpleNamespace(cfg=plain, plan=resolve_plan(plain), actor=Group("actor"), critic=Group("critic"), ptx=None)
    setup.RLSetup.save_checkpoint(s, 4, 7)
    setup.save_final(s)
    assert [c[1:3] for c in calls] == [("save_checkpoint", "/c/actor"), ("save_checkpoint", "/c/critic"),
                                       ("save_hf", "/out")]


def test_training_micro_batches_follow_the_flags():
    from rlhfkit.rl.worker import micro_batches

    lengths = [2, 2, 3, 3, 4, 4, 5, 5]
    mask = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    batch = {"sequences": torch.zeros(8, 8, dtype=torch.long), "attention_mask": mask}

    def sizes(*flags):
        cfg = ppo_cfg(**dict(flags))
        budget = cfg.train_max_tokens_per_gpu if cfg.use_dynamic_batch else None
        return [mb["sequences"].shape[0] for mb in micro_batches(batch, cfg.micro_train_batch_size, budget)]

    assert sizes() == [4, 4]  # default --micro_train_batch_size 4
    assert sizes(("micro_train_batch_size", 3)) == [3, 3, 2]
    # --use_dynamic_batch: rows up to --train_max_tokens_per_gpu real tokens each
    assert sizes(("use_dynamic_batch", True), ("train_max_tokens_per_gpu", 8)) == [3, 2, 1, 1, 1]


def test_forward_micro_batches_follow_the_rollout_budget():
    """--rollout_max_tokens_per_gpu cuts the log-prob / value / reward passes by real tokens under
    --use_dynamic_batch (falling back to --train_max_tokens_per_gpu); rows keep their order."""
    from rlhfkit.rl.worker import micro_batches, rollout_budget

    lengths = [2, 5, 3, 4, 4, 2]
    mask = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    batch = {"sequences": torch.arange(6).view(6, 1).expand(6, 8), "attention_mask": mask}

    def rows(*flags):
        cfg = ppo_cfg(**dict(flags))
        return [mb["sequences"][:, 0].tolist() for mb in micro_batches(batch, cfg.micro_rollout_batch_size,
                                                                          rollout_budget(cfg))]

    assert rows(("micro_rollout_batch_size", 4)) == [[0, 1, 2, 3], [4, 5]]  # no budget without the switch
    assert rows(("micro_rollout_batch_size", 4), ("rollout_max_tokens_per_gpu", 8)) == [[0, 1, 2, 3], [4, 5]]
    dynamic = ("use_dynamic_batch", True)
    assert rows(dynamic, ("rollout_max_tokens_per_gpu", 8)) == [[0, 1], [2, 3], [4, 5]]
    assert rows(dynamic, ("train_max_tokens_per_gpu", 10)) == [[0, 1, 2], [3, 4, 5]]


def test_rollout_backend_and_vllm_dtype_pick_the_engines(monkeypatch):
    import rlhfkit.rollout.hf_engine as hf_engine
    import rlhfkit.rollout.vllm_engine as vllm_engine

    made = []
    monkeypatch.setattr(hf_engine, "create_hf_engines", lambda n, path, **kw: made.append(("hf", n, kw)) or [])
    monkeypatch.setattr(vllm_engine, "create_vllm_engines", lambda n, path, **kw: made.append(("vllm", n, kw)) or [])
    def engines(**flags):
        cfg = ppo_cfg(**flags)
        setup._engines(cfg, resolve_plan(cfg).with_model_path("m"), placement.Placement())

    engines(rollout_backend="hf", vllm_dtype="bf16")
    engines(vllm_dtype="fp16", param_dtype="fp32")
    # no run folder here: Ray's log stream; indices: which engines (all of them; a restart names one)
    assert made[0] == ("hf", 1, {"dtype": "bfloat16", "log_dir": None, "indices": None})
    assert made[1][0] == "vllm" and made[1][2]["dtype"] == "float16"  # --vllm_dtype, not the trainer's fp32


def test_reward_flags_combine_the_ppo_reward_sources(tokenizer, tmp_path):
    """--remote_rm_url (two built-ins), --reward_combine, --reward_weights, --reward_error_policy, --reward_timeout
    on the reward function `build_setup` makes (text sources only: no Ray)."""
    texts, prompts, labels = ["x 1", "x 2"], ["x", "x"], ["1", "3"]  # exact: 1, 0; format: 0, 0
    failing = tmp_path / "failing.py"
    failing.write_text("def reward_func(queries, prompts, labels):\n    raise RuntimeError('boom')\n")

    def rewards(**flags):
        cfg = ppo_cfg(**flags)
        return setup.build_rewards(cfg, tokenizer, [], [])(texts, prompts, labels).rewards.tolist()

    both = "builtin:exact,builtin:format"
    assert rewards(remote_rm_url=both) == [0.5, 0.0]  # mean
    assert rewards(remote_rm_url=both, reward_combine="sum") == [1.0, 0.0]
    assert rewards(remote_rm_url=both, reward_weights="3,1") == [3.0, 0.0]
    assert rewards(remote_rm_url=f"{failing},builtin:exact", reward_error_policy="zero") == [0.5, 0.0]
    with pytest.raises(Exception, match="boom"):
        rewards(remote_rm_url=str(failing))  # --reward_error_policy raise (the default)
    source = setup.text_sources(ppo_cfg(remote_rm_url="builtin:exact", reward_timeout=2.5))[0]
    assert source.timeout == 2.5


def test_overlong_penalty_factor_scales_the_penalty_of_the_step_rewards():
    """--overlong_buffer_len 4 before --generate_max_len 16 with --overlong_penalty_factor 0.5, as parsed, through the
    step's apply_length_penalties: r - min(max(|y| - 12, 0), 4) / 4 x 0.5 (the default factor 1 would reach -1)."""
    from rlhfkit.rl.make_experience import apply_length_penalties

    cfg = ppo_cfg(pretrain="m", prompt_data="d", generate_max_len=16, overlong_buffer_len=4,
                  overlong_penalty_factor=0.5)
    lengths = torch.tensor([0, 10, 12, 13, 15, 16])
    exp = SimpleNamespace(rewards=torch.ones(6), response_length=lengths, info={"truncated": torch.zeros(6)})
    rollout = SimpleNamespace(rewards=exp.rewards)
    metrics = apply_length_penalties(rollout, exp, cfg)
    want = [1.0 - min(max(n - 12, 0), 4) / 4 * 0.5 for n in lengths.tolist()]
    assert want[-1] == 0.5
    assert exp.rewards.tolist() == pytest.approx(want) and rollout.rewards is exp.rewards
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(sum(w - 1.0 for w in want) / 6)
