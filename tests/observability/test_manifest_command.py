"""The manifest's reproduce command: a torchrun line for the offline commands on several ranks, the plain command
for ppo (its Ray driver starts the ranks itself, whatever --actor_num_gpus_per_node says)."""

from __future__ import annotations

import json

from rlhfkit.config.parse import parse_config
from rlhfkit.observability.run import write_manifest


def test_ppo_on_two_actor_ranks_is_reproduced_by_the_plain_command(tmp_path):
    argv = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--actor_num_gpus_per_node", "2"]
    cfg = parse_config("ppo", None, argv)
    manifest = write_manifest(tmp_path, cfg, world_size=2, torchrun=False)
    assert manifest["command"] == "rlhfkit ppo " + " ".join(argv)
    assert json.loads((tmp_path / "manifest.json").read_text())["hardware"]["world_size"] == 2


def test_an_offline_command_on_two_ranks_is_a_torchrun_line(tmp_path):
    from rlhfkit.cli.sft import GROUPS

    cfg = parse_config("sft", GROUPS, ["--pretrain", "m", "--dataset", "d.jsonl"])
    manifest = write_manifest(tmp_path, cfg, world_size=2)
    assert manifest["command"] == "torchrun --nproc_per_node 2 -m rlhfkit.cli.sft --pretrain m --dataset d.jsonl"
