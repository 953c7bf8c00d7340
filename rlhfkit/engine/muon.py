"""`--optim muon`: torch.optim.Muon for the 2-D hidden weight matrices, torch.optim.AdamW for everything else, behind
one torch Optimizer (one schedule, one checkpoint, one state for offloading).

Muon step for a matrix W (m x n) with gradient G, torch's formulas (torch/optim/_muon.py):

    B <- mu B + (1 - mu) G                                  momentum buffer (mu = --muon_momentum)
    U = (1 - mu) G + mu B  (nesterov)   or   U = B          --muon_nesterov / --no-muon_nesterov
    X_0 = U / max(||U||_F, 1e-7)   (transposed first when m > n), then k = --muon_ns_steps quintic iterations
    X_{j+1} = a X_j + (b A + c A^2) X_j,  A = X_j X_j^T,  (a, b, c) = (3.4445, -4.7750, 2.0315)
    W <- W (1 - lr wd) - lr sqrt(max(1, m / n)) X_k         lr = --muon_lr x schedule, wd = --l2

torch runs the Newton-Schulz iteration in bfloat16. Under FSDP2 the parameters, gradients and momentum are DTensors
sharded along dim 0; torch's Muon computes on them with DTensor ops, so the iteration runs on the whole matrix (the
matmuls redistribute the shards), not on each rank's rows: a sharded step equals the unsharded one up to bf16
rounding (tests/engine/test_muon.py checks this on 2 gloo ranks).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

# Parameters under a module of this name stay with AdamW: the LM head and the scalar (value / reward) head.
HEAD_NAMES = ("lm_head", "score")


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Split the trainable parameters into (Muon, AdamW with weight decay, AdamW without).

    Muon: every 2-D parameter except embeddings (weights of nn.Embedding modules), the output embeddings
    (`get_output_embeddings()`, lm_head) and the heads named in HEAD_NAMES (a critic's or reward model's `score`);
    LoRA's A and B matrices are 2-D hidden weights too. AdamW with --l2: those exempt matrices. AdamW without weight
    decay: 1-D (and 0-D) parameters, i.e. norms and biases."""
    exempt: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            exempt.update(id(p) for p in module.parameters())
    hf: Any = model  # a transformers model: get_output_embeddings is not nn.Module's
    output = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if output is not None:
        exempt.update(id(p) for p in output.parameters())
    muon, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2:
            no_decay.append(param)
        elif param.ndim == 2 and id(param) not in exempt and not set(name.split(".")) & set(HEAD_NAMES):
            muon.append(param)
        else:
            decay.append(param)
    return muon, decay, no_decay


class MuonWithAdamW(torch.optim.Optimizer):
    """One Optimizer over two torch optimizers: a Muon over `muon_params`, an AdamW over `adamw_groups`.

    The param groups (AdamW's first, so `param_groups[0]["lr"]` is --learning_rate's schedule) and the state are
    this object's own, shared with the inner optimizers before each step, so `state_dict` / `load_state_dict`, DCP
    checkpoints, LambdaLR and moving the state between devices see one optimizer. Each group carries `kind`."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_groups: list[dict[str, Any]], *, lr: float,
                 betas: tuple[float, ...], eps: float, muon_lr: float, momentum: float, nesterov: bool, ns_steps: int,
                 weight_decay: float, adamw_kwargs: dict[str, Any] | None = None) -> None:
        self._inner: dict[str, torch.optim.Optimizer] = {}
        groups = [g for g in adamw_groups if g["params"]]
        if groups:
            self._inner["adamw"] = torch.optim.AdamW(groups, lr=lr, betas=cast(tuple[float, float], betas), eps=eps,
                                                   **(adamw_kwargs or {}))
        if muon_params:
            self._inner["muon"] = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=weight_decay,
                                                   momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        for kind, inner in self._inner.items():
            for group in inner.param_groups:
                group["kind"] = kind
        super().__init__([g for inner in self._inner.values() for g in inner.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for kind, inner in self._inner.items():
            # load_state_dict replaces this object's groups and state: hand the current ones to the inner optimizer
            inner.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            inner.state = self.state
            inner.step()
        return loss
