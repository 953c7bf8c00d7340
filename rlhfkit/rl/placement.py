"""The placement groups of an online run: every role is a `ModelGroup` of `--<role>_num_nodes x
--<role>_num_gpus_per_node` ranks in a Ray placement group. `--colocate_actor_ref` puts the reference on the actor's
bundles, `--colocate_critic_reward` the reward model(s) on the critic's, `--colocate_all_models` every model and the
vLLM engines on the actor's; roles on the same bundles split it (a fraction of a GPU each, or of the bundle's logical
CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import RunPlan
from rlhfkit.rl.group import ModelGroup, make_placement_group
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import RemoteActors


@dataclass
class Placement:
    """The placement groups of a run and how many roles share each one's bundles."""

    groups: dict[str, Any] = field(default_factory=dict)   # role -> placement group
    sharing: dict[int, int] = field(default_factory=dict)  # id(placement group) -> roles on its bundles
    owned: list[Any] = field(default_factory=list)

    def new(self, plan: RunPlan, role: str) -> Any:
        pg = make_placement_group(plan.nodes(role), plan.ranks_per_node(role), 1.0)
        self.owned.append(pg)
        return pg

    def put(self, role: str, pg: Any) -> None:
        self.groups[role] = pg
        self.sharing[id(pg)] = self.sharing.get(id(pg), 0) + 1

    def share(self, role: str) -> float:
        """The fraction of a bundle each role on `role`'s placement group gets."""
        return 1.0 / self.sharing[id(self.groups[role])]


def plan_placement(cfg: PPOConfig, plan: RunPlan, reward_specs: list[str], create_engines: bool) -> Placement:
    """Placement groups per role: roles named by a colocation flag share the bundles of the group they join."""
    has_critic, need_ref = plan.needs_critic, plan.needs_ref
    p = Placement()
    p.put("actor", p.new(plan, "actor"))
    everything = cfg.colocate_all_models
    if need_ref:
        p.put("ref", p.groups["actor"] if (everything or cfg.colocate_actor_ref) else p.new(plan, "ref"))
    if has_critic:
        p.put("critic", p.groups["actor"] if everything else p.new(plan, "critic"))
    for k, _ in enumerate(reward_specs):
        if everything:
            pg = p.groups["actor"]
        elif cfg.colocate_critic_reward and has_critic:
            pg = p.groups["critic"]
        else:
            pg = p.new(plan, "reward")
        p.put(f"reward{k}", pg)
    if everything and create_engines:
        p.put("engines", p.groups["actor"])
    return p


def collect_whereabouts(groups: list[ModelGroup], engines: list[Any]) -> list[dict[str, Any]]:
    """Every rank of every model group, then every engine (`engine` = its index in the run's list). Each call has
    the run's deadline (--remote_call_timeout): a hung or dead rank or engine raises `RemoteCallTimeout` /
    `RemoteActorDied` naming it (role, rank, node, `whereabouts`), and a rank silent past --trainer_hang_timeout
    `RemoteActorHung`, as every other call of the run does."""
    ranks = [entry for group in groups for entry in RemoteActors(group.workers, role=group.role,
                                                                 heartbeats=group.heartbeats).call(ModelWorker.whereabouts)]
    found = RemoteActors(engines, role="engine").call(RolloutEngine.whereabouts) if engines else []
    return ranks + [{**entry, "engine": k} for k, entry in enumerate(found)]
