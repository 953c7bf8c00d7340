"""Run under torchrun by tests/engine/test_muon.py: two Muon steps of the tiny model sharded by FSDP2
(rlhfkit.engine.fsdp.shard_model, every rank a Shard(0) slice of each matrix) on WORLD_SIZE gloo ranks, with the same
Gaussian gradients on every rank; rank 0 saves the gathered parameters before and after.

usage: _muon_sharded.py MODEL_DIR OUT.pt SETTINGS_JSON"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from rlhfkit.config.optim_options import OptimSettings
from rlhfkit.engine.distributed import init_distributed, shutdown_distributed
from rlhfkit.engine.fsdp import shard_model
from rlhfkit.engine.optim import make_optimizer
from rlhfkit.models.loading import load_causal_lm


def main(model_dir: str, out: str, settings: str) -> None:
    info = init_distributed()
    model = shard_model(load_causal_lm(model_dir), zero_stage=3, device=info.device, param_dtype="fp32")
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    full = {n: p.full_tensor().clone() for n, p in params.items()}
    optimizer = make_optimizer(model, OptimSettings(**json.loads(settings)))
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        for p in params.values():
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, p.placements)
        optimizer.step()
    after = {n: p.full_tensor() for n, p in params.items()}
    if info.rank == 0:
        torch.save({"before": full, "after": after,
                    "local_rows": {n: p.to_local().shape[0] for n, p in params.items()}}, out)
    shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
