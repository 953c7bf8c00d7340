"""One rank of the 2-process gloo check in test_distributed.py (run as a script, not collected by pytest).

argv: rank world_size store_file inputs_file output_file. Rank r takes the rows listed for it in the inputs,
computes every global statistic with the WORLD group, and rank 0 also computes them on the full batch with a
1-member group; each rank writes its results with torch.save.
"""

import sys

import torch
import torch.distributed as dist

from rlhfkit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages_and_returns,
    kto_reference_kl,
    logprob_mismatch,
    masked_mean,
    masked_var,
    masked_whiten,
)


def compute(inp: dict, rows: slice, group) -> dict:
    mask, rewards = inp["mask"][rows], inp["rewards"][rows]
    values, kl, x = inp["values"][rows], inp["kl"][rows], inp["x"][rows]
    out = {"mean": masked_mean(x, mask, process_group=group), "whiten": masked_whiten(x, mask, process_group=group)}
    out["mean_var"] = torch.stack(masked_var(x, mask, process_group=group))
    for est in ADVANTAGE_ESTIMATORS:
        for std_norm in (True, False):
            out[f"{est}/{std_norm}"] = compute_advantages_and_returns(
                est, rewards, mask, n_samples_per_prompt=inp["n"], values=values, kl=kl, kl_coef=0.05,
                gamma=0.99, lambd=0.95, std_norm=std_norm, process_group=group,
                student_log_probs=x, teacher_log_probs=values,  # on_policy_distill reads these two
            )
    out["whiten32"] = masked_whiten(x.float(), mask, process_group=group)
    out["kto_z"] = kto_reference_kl(x[:, 2], x[:, 3] - 1.0, process_group=group)
    out["mismatch"] = logprob_mismatch(x, values, mask, process_group=group)
    return out


def main() -> None:
    rank, world, store_file, inputs_file, output_file = sys.argv[1:6]
    rank, world = int(rank), int(world)
    store = dist.FileStore(store_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    inp = torch.load(inputs_file)
    solo = dist.new_group([0])
    results = {"split": compute(inp, slice(*inp["splits"][rank]), dist.group.WORLD)}
    if rank == 0:
        results["one_rank"] = compute(inp, slice(None), solo)
    dist.barrier()
    torch.save(results, output_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
