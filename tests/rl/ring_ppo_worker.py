"""One rank of the gloo check in test_ring_ppo.py (a script, not collected by pytest).

argv: rank world_size master_port model_dir reward_model_dir output_file flags_json (the ring flags: none for the
unsharded reference; --ring_attn_size 2 for each sequence split over the two ranks). The rank builds ppo's real actor,
reference and critic workers (`rlhfkit.rl.worker.ModelWorker`, as the Ray actors do) and, for a padded and a packed
layout of the same micro-batches, records the actor's and reference's log-probs, the critic's values, a reward
model's scores (unsharded only), and one policy and one value step: their metrics and the full parameter gradients
the optimizer sees; and the fresh value head of a critic started from the causal LM. Output with torch.save.
"""

import json
import sys

import torch

from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.rl.experience import build_experience
from rlhfkit.rl.forward import forward_strategy
from rlhfkit.rl.worker import ModelWorker

# shared prompts (packed: computed once), an empty response, uneven lengths: 32 packed tokens, odd padded widths
PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [11, 12], [13, 14, 15]]
RESPONSES = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [], [31, 32, 33, 34]]


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    exp = build_experience(PROMPTS, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], [0, 0, 0, 1, 1, 2], 0)
    mask = exp.action_mask.float()
    exp.advantages = torch.randn(mask.shape, generator=g) * mask
    exp.values = torch.randn(mask.shape, generator=g) * 0.1 * mask
    exp.returns = torch.randn(mask.shape, generator=g) * mask
    return exp.tensors()


def scored_batch() -> dict[str, torch.Tensor]:
    """The reward group's input for the same samples (left-padded, eos appended, prompt lengths for packing)."""
    from rlhfkit.rl.reward_group import reward_batch
    from rlhfkit.rollout.types import RolloutSample

    samples = [RolloutSample(k, i, p, r, [0.0] * len(r), "stop")
               for i, (k, p, r) in enumerate(zip([0, 0, 0, 1, 1, 2], PROMPTS, RESPONSES))]
    return reward_batch(samples, eos_token_id=2, pad_token_id=0)


def capture_gradients(worker: ModelWorker, into: dict) -> None:
    """Record the full (gathered) gradients just before each optimizer step."""
    engine = worker.engine
    original = engine.optimizer_step

    def step(report=None):
        for name, p in engine.model.named_parameters():
            g = p.grad
            into[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return original(report)

    engine.optimizer_step = step


def count_kv_gathers(into: list[int]) -> None:
    """Record the number of key/value heads in each all-gather of the ring attention (--ring_head_stride: that many
    heads per message), by wrapping the module function ring_attention_forward calls."""
    import rlhfkit.models.context_parallel as cp

    original = cp.gather_along

    def gather_along(tensor, dim, ring):
        if dim == 2:  # keys/values [B, heads, C, d] along the sequence; sum_over_ring gathers along 0
            into.append(tensor.shape[1])
        return original(tensor, dim, ring)

    cp.gather_along = gather_along


def main() -> None:
    rank, world, port, model_dir, reward_dir, output_file, ring_flags = sys.argv[1:8]
    rank, world = int(rank), int(world)
    flags = {"pretrain": model_dir, "prompt_data": "p", "remote_rm_url": "builtin:format", "advantage_estimator": "gae",
             "actor_learning_rate": 1e-3, "critic_learning_rate": 1e-3, "micro_train_batch_size": 3,
             "micro_rollout_batch_size": 4, "temperature": 0.7, "init_kl_coef": 0.1, "use_kl_loss": True,
             "kl_estimator": "k3", "seed": 1, **json.loads(ring_flags)}
    cfg = parse_config("ppo", GROUPS, flags_to_argv({**flags, "torch_threads_per_worker": 1}))
    workers = {role: ModelWorker(role, cfg, rank, world, "127.0.0.1", int(port)) for role in ("actor", "ref", "critic")}
    workers["actor"].init_model(model_dir, True, 10, 0.0)  # lr 0: both layouts see the same weights
    workers["ref"].init_model(model_dir, False)
    workers["critic"].init_model(reward_dir, True, 10, 0.0, True)
    # the unsharded run also scores with a reward model, for the packed-vs-padded check of its scores (never a ring;
    # and not beside ring workers in one process: their ring attention is set up for the whole process)
    scorer = ModelWorker("reward", cfg, rank, world, "127.0.0.1", int(port)) if world == 1 else None
    if scorer is not None:
        scorer.init_model(reward_dir, False, 1, 0.0, True, True)
    fresh = ModelWorker("critic", cfg, rank, world, "127.0.0.1", int(port))  # a critic started from the causal LM
    fresh.init_model(model_dir, False, scalar_head=True)
    head = fresh.model.score.weight
    kv_heads: list[int] = []
    count_kv_gathers(kv_heads)
    grads: dict[str, dict] = {"actor": {}, "critic": {}}
    capture_gradients(workers["actor"], grads["actor"])
    capture_gradients(workers["critic"], grads["critic"])
    out: dict = {"ring": [w.ring.size if w.ring else 1 for w in workers.values()],
                 "fresh_head": (head.full_tensor() if hasattr(head, "full_tensor") else head).detach().clone()}
    for layout in ("padded", "packed"):
        for w in (*workers.values(), *([scorer] if scorer else [])):
            w.cfg.packing_samples = layout == "packed"
            # a worker picks its forward strategy once, at init_model: pick it again for this layout (rl/forward.py)
            w.forward = forward_strategy(w.cfg, ring=w.ring, vision=False, truncation=w.truncation,
                                         mask_dtype=w.forward.mask_dtype)
        data = batch()
        data["ref_log_probs"] = workers["ref"].log_probs(data)
        result = {"log_probs": workers["actor"].log_probs(data), "ref_log_probs": data["ref_log_probs"],
                  "values": workers["critic"].values(data), "action_mask": data["action_mask"]}
        tokens = float(data["action_mask"].sum())
        result["policy"] = workers["actor"].train_policy_step(data, tokens)
        result["actor_grads"] = dict(grads["actor"])
        result["critic"] = workers["critic"].train_critic_step(data, tokens)
        result["critic_grads"] = dict(grads["critic"])
        result["probe"] = workers["actor"].probe_log_probs([PROMPTS[0]], [RESPONSES[2]])[0]
        if scorer is not None:
            result["rewards"] = scorer.rewards(scored_batch())
        out[layout] = result
    out["kv_heads_per_gather"] = sorted(set(kv_heads))
    torch.save(out, output_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
