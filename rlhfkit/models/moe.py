"""Mixture-of-experts models: detection and the router load-balancing loss (``--aux_loss_coef``).

``RouterAuxLoss(model)`` makes every forward of ``model`` ask for the routers' logits (``output_router_logits=True``,
as OpenRLHF does) and keeps the model's own ``outputs.aux_loss`` (transformers' ``load_balancing_loss_func``: the
Switch-Transformer loss ``E * sum_e f_e * P_e`` over the tokens of the batch, top-k routing, padding masked out).
Outputs that do not carry it (a sequence-classification head drops the router logits) get the same loss computed
from logits captured on the router modules. Only gradient-enabled forwards count (eval, reference and old-log-prob
passes do not). ``pop()`` returns the mean loss of the forwards since its last call; the caller adds
``coef * aux``. Works through PEFT wrappers and FSDP2 (the hooks sit on the root module and on the routers).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def _inner(model: Any) -> nn.Module:
    """The transformers model under PEFT / FSDP wrappers."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def router_recorder(model: nn.Module) -> Any | None:
    """transformers' record of the router modules (``_can_record_outputs["router_logits"]``), None for a dense model."""
    records = getattr(type(_inner(model)), "_can_record_outputs", None) or {}
    return records.get("router_logits")


def moe_config(model: nn.Module) -> tuple[int, int] | None:
    """(number of experts, experts per token) of a mixture-of-experts model, None for a dense one."""
    config = getattr(_inner(model), "config", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if router_recorder(model) is None or not experts or not top_k:
        return None
    return int(experts), int(top_k)


def is_moe(model: nn.Module) -> bool:
    return moe_config(model) is not None


def load_balancing_loss(router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func``: per expert, the fraction of (token, layer) top-k assignments
    ``f_e`` and the mean router probability ``P_e`` over non-padding tokens of every layer; ``E * sum_e f_e * P_e``."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    flat = None
    if attention_mask is not None and attention_mask.dim() == 2:
        flat = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        weights = torch.softmax(logits.float(), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        mask = flat if flat is not None and flat.numel() == weights.shape[0] else torch.ones(
            weights.shape[0], device=device)
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probs = probs + (weights * mask.unsqueeze(-1)).sum(0)
        rows = rows + mask.sum()
    return (counts / rows * (probs / rows)).sum() * num_experts


class RouterAuxLoss:
    """Captures the load-balancing loss of each forward of ``model`` (an MoE model; see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        found = moe_config(model)
        if found is None:
            raise ValueError(f"{type(_inner(model)).__name__} is not a mixture-of-experts model")
        self.num_experts, self.top_k = found
        self._logits: list[torch.Tensor] = []
        self._mask: torch.Tensor | None = None
        self._auxes: list[torch.Tensor] = []
        recorder: Any = router_recorder(model)
        index = getattr(recorder, "index", 0) or 0
        routers = [m for m in _inner(model).modules() if isinstance(m, recorder.target_class)]
        self._accepts_flag = "output_router_logits" in inspect.signature(_inner(model).forward).parameters
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after)]
        for router in routers:
            self._handles.append(router.register_forward_hook(
                lambda _m, _i, out: self._logits.append(out[index] if isinstance(out, tuple) else out)))

    def _before(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._logits = []
        self._mask = kwargs.get("attention_mask")
        if self._accepts_flag:
            kwargs = {**kwargs, "output_router_logits": True}
        return args, kwargs

    def _after(self, _module: nn.Module, _args: tuple, output: Any) -> None:
        logits, self._logits = self._logits, []
        if not torch.is_grad_enabled():  # eval, reference-style and old-log-prob passes train nothing
            return
        aux = getattr(output, "aux_loss", None)
        if not torch.is_tensor(aux):
            aux = load_balancing_loss(logits, self.num_experts, self.top_k, self._mask) if logits else None
        if aux is not None:
            self._auxes.append(aux)

    def pop(self) -> torch.Tensor | None:
        """The mean load-balancing loss of the gradient-enabled forwards since the last call (a scalar with its
        graph; a method that runs the trained model twice per micro-batch gets the mean), None if none ran."""
        auxes, self._auxes = self._auxes, []
        return torch.stack([a.float() for a in auxes]).mean() if auxes else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
