"""`rlhfkit.config.plan`: each derived fact of an online run, from the flags that decide it (#12)."""

from __future__ import annotations

import pytest

from rlhfkit.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlhfkit.algorithms.advantages import GROUP_ESTIMATORS as ALGORITHM_GROUP_ESTIMATORS
from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.config.plan import GROUP_ESTIMATORS, RunPlan, kl_mode_of, resolve_plan


def plan(has_gpus: bool | None = None, **flags) -> RunPlan:
    return resolve_plan(parse_config("ppo", GROUPS, flags_to_argv({"pretrain": "m", "prompt_data": "p", **flags})),
                        has_gpus)


def test_group_estimators_agree_with_the_algorithms():
    assert set(GROUP_ESTIMATORS) == set(ALGORITHM_GROUP_ESTIMATORS)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_critic_and_groups_follow_the_estimator(estimator):
    p = plan(advantage_estimator=estimator)
    assert p.estimator == estimator
    assert p.needs_critic == (estimator == "gae")
    assert p.group_estimator == (estimator in ("reinforce_baseline", "group_norm", "dr_grpo", "rloo"))


def test_the_default_is_gae_with_a_kl_penalty():
    p = plan()
    assert (p.needs_critic, p.group_estimator, p.kl_mode, p.needs_ref) == (True, False, "penalty", True)


@pytest.mark.parametrize("coef, loss, mode", [(0.01, False, "penalty"), (0.01, True, "loss"), (0.0, False, "off"),
                                              (0.0, True, "off"), (-1.0, False, "off")])
def test_kl_mode(coef, loss, mode):
    assert kl_mode_of(coef, loss) == mode
    p = plan(init_kl_coef=coef, use_kl_loss=loss)
    assert p.kl_mode == mode
    assert p.needs_ref == (mode != "off")


def test_world_size_of_each_role():
    p = plan(actor_num_nodes=2, actor_num_gpus_per_node=3, ref_num_gpus_per_node=2, critic_num_nodes=4,
             reward_num_nodes=1, reward_num_gpus_per_node=5)
    assert [p.world(r) for r in ("actor", "ref", "critic", "reward")] == [6, 2, 4, 5]
    assert (p.nodes("actor"), p.ranks_per_node("actor")) == (2, 3)
    assert (p.nodes("critic"), p.ranks_per_node("critic")) == (4, 1)
    with pytest.raises(KeyError, match="engines"):
        p.world("engines")


def test_sync_transport_is_resolved_against_the_cluster():
    assert plan().sync_transport is None  # not known before Ray runs
    assert plan(has_gpus=False).sync_transport == "gloo"
    assert plan(has_gpus=True).sync_transport == "nccl"
    assert plan(has_gpus=True, colocate_all_models=True).sync_transport == "ray"
    assert plan(has_gpus=False, vllm_sync_backend="ray").sync_transport == "ray"
    assert plan(has_gpus=False, vllm_sync_backend="nccl").sync_transport == "gloo"  # falls back (#13)


def test_the_plan_is_frozen():
    p = plan()
    with pytest.raises(AttributeError):
        p.kl_mode = "loss"  # type: ignore[misc]
