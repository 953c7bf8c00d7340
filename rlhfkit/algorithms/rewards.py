"""Reward shaping, clipping and KL-coefficient controllers.

A sequence reward ``r_b`` (one scalar per response, ``[batch]``) becomes a token reward ``[batch, response_len]``:
it is placed on the last valid token and a KL penalty ``-beta * kl_t`` is added on every valid token.
"""

from __future__ import annotations

import torch

from .normalize import as_bool_mask, compute_dtype


def clip_rewards(rewards: torch.Tensor, clip_range: tuple[float, float] | None) -> torch.Tensor:
    """``clamp(r, low, high)`` for ``clip_range = (low, high)`` (``--reward_clip_range``); None: unchanged."""
    if clip_range is None:
        return rewards
    low, high = clip_range
    if low > high:
        raise ValueError(f"--reward_clip_range must be (low, high) with low <= high, got {clip_range}")
    return rewards.clamp(low, high)


def overlong_penalty(
    response_lengths: torch.Tensor, max_new_tokens: int, buffer_len: float, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (``--overlong_buffer_len``, ``--overlong_penalty_factor``), ``[batch]``:
    with ``L_max = max_new_tokens`` (``--generate_max_len``), ``L_buf = buffer_len`` and the response length ``|y|``,
    ``p = -min(max(|y| - (L_max - L_buf), 0), L_buf) / L_buf * penalty_factor``: 0 up to ``L_max - L_buf`` tokens,
    then a linear ramp down to ``-penalty_factor`` at ``L_max``. The trainer adds it to the sequence reward."""
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"--overlong_buffer_len must be in (0, --generate_max_len = {max_new_tokens}], "
                         f"got {buffer_len}")
    lengths = response_lengths.to(torch.float64)
    exceed = (lengths - (max_new_tokens - buffer_len)).clamp(min=0.0, max=float(buffer_len))
    return -exceed / buffer_len * penalty_factor


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL's stop-properly penalty (``--stop_properly_penalty_coef c``) on sequence rewards ``[batch]``: a response
    cut at the length limit (finish reason ``length``, ``truncated`` true) gets ``c r`` when ``0 <= c <= 1`` and
    the fixed reward ``c`` when ``c < 0``; the others keep ``r``."""
    if coef > 1:
        raise ValueError(f"--stop_properly_penalty_coef must be in [0, 1] (a scale) or < 0 (a fixed reward), "
                         f"got {coef}")
    cut = truncated.to(torch.bool)
    penalised = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(cut, penalised, rewards)


def length_penalties(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    truncated: torch.Tensor,
    max_new_tokens: int,
    *,
    overlong_buffer_len: float | None = None,
    overlong_penalty_factor: float = 1.0,
    stop_properly_penalty_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Both length penalties in OpenRLHF's order: ``r <- r + overlong_penalty(|y|)`` (when ``overlong_buffer_len``
    is set), then ``r <- stop_properly_penalty(r, truncated, c)`` (when ``c`` is set). Returns the new rewards (the
    dtype of ``rewards``) and metrics: ``overlong_penalized_frac``, ``overlong_penalty_mean`` (mean over the batch),
    ``stop_properly_penalized_frac`` (share of truncated responses), ``length_penalty_mean`` (mean change of r)."""
    out = rewards.to(torch.float64)
    metrics: dict[str, float] = {}
    if overlong_buffer_len is not None:
        pen = overlong_penalty(response_lengths, max_new_tokens, overlong_buffer_len, overlong_penalty_factor)
        out = out + pen
        metrics["overlong_penalized_frac"] = float((pen < 0).double().mean())
        metrics["overlong_penalty_mean"] = float(pen.mean())
    if stop_properly_penalty_coef is not None:
        out = stop_properly_penalty(out, truncated, stop_properly_penalty_coef)
        metrics["stop_properly_penalized_frac"] = float(truncated.to(torch.float64).mean())
    if metrics:
        metrics["length_penalty_mean"] = float((out - rewards.to(torch.float64)).mean())
    return out.to(rewards.dtype), metrics


def last_token_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row, ``max{t : m[b, t] != 0}``; -1 for a row with no valid token."""
    m = action_mask != 0
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=-1)


def shape_rewards(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token rewards ``R[b, t] = 1[t = T_b] * r_b - kl_coef * kl[b, t]`` on valid tokens, 0 elsewhere.

    ``T_b`` is the last valid token of row b (a row with no valid token gets nothing: its reward has nowhere to
    go). ``kl`` is the per-token estimate from ``kl.compute_kl`` (``--kl_estimator``); ``kl_coef`` is
    ``--init_kl_coef`` (0 with ``--use_kl_loss``, where KL is a loss term instead). Clip ``rewards`` first with
    :func:`clip_rewards` if wanted.
    """
    if rewards.dim() != 1 or action_mask.dim() != 2 or rewards.shape[0] != action_mask.shape[0]:
        raise ValueError(
            f"shape_rewards wants rewards [batch] and action_mask [batch, len], got {tuple(rewards.shape)} and "
            f"{tuple(action_mask.shape)}"
        )
    if kl_coef < 0:
        raise ValueError(f"the KL coefficient must be >= 0, got {kl_coef}")
    m = as_bool_mask(action_mask, action_mask)
    dtype = compute_dtype(rewards)
    last = last_token_index(m)
    at_last = torch.arange(m.shape[-1], device=m.device).unsqueeze(0) == last.unsqueeze(-1)
    out = torch.where(at_last, rewards.to(dtype).unsqueeze(-1), torch.zeros((), dtype=dtype, device=m.device))
    if kl is not None and kl_coef != 0:
        if kl.shape != m.shape:
            raise ValueError(f"kl has shape {tuple(kl.shape)}, the action mask {tuple(m.shape)}")
        out = out - kl_coef * kl.to(dtype)
    return torch.where(m, out, torch.zeros((), dtype=dtype, device=m.device))


class FixedKLController:
    """Constant KL coefficient ``beta = init_kl_coef`` (``--init_kl_coef`` without ``--kl_target``)."""

    def __init__(self, init_kl_coef: float) -> None:
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}`` for the checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``beta`` saved by :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019) (``--kl_target``, ``--kl_horizon``):
    ``e = clip(KL / kl_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / kl_horizon)``.
    """

    def __init__(self, init_kl_coef: float, kl_target: float, kl_horizon: float) -> None:
        if kl_target <= 0 or kl_horizon <= 0:
            raise ValueError(f"--kl_target and --kl_horizon must be > 0, got {kl_target} and {kl_horizon}")
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon = float(kl_horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``beta <- beta * (1 + clip(current_kl / kl_target - 1, -0.2, 0.2) * n_steps / kl_horizon)``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}`` for the checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``beta`` saved by :meth:`state_dict`."""
        self.value = float(state["value"])
