"""The router load-balancing loss written independently of transformers and rlhfkit, in float64 (MoE tests)."""

from __future__ import annotations

import torch


def reference_aux_loss(router_logits, attention_mask: torch.Tensor, num_experts: int, top_k: int) -> float:
    """E * sum_e f_e * P_e in float64: f_e the fraction of top-k (token, layer) assignments to expert e, P_e the
    mean router probability of e, both over the non-padding tokens of every layer (transformers' definition)."""
    mask = attention_mask.reshape(-1).double()
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0.0
    for logits in router_logits:
        p = torch.softmax(logits.double(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        for k in range(top_k):
            counts += torch.zeros(num_experts, dtype=torch.float64).index_add(0, chosen[:, k], mask)
        probs += (p * mask[:, None]).sum(0)
        rows += float(mask.sum())
    return float(num_experts * ((counts / rows) * (probs / rows)).sum())
