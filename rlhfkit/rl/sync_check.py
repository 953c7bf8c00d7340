"""After the engines get weights (at start and after every sync): do they compute what the trainer computes?

The loaded-names check (`rlhfkit.rollout.worker_ext.check_every_parameter_loaded`) proves every engine parameter
was written; this check proves that what was written is what the engine computes with. It scores one fixed probe
sequence (the first prompt, then the second prompt's first tokens as a "response") on every engine (`score`,
temperature 1) and on the actor (`probe_log_probs`, the same forward the trainer uses), and compares

    diff = mean_t | log p_engine(y_t | y_<t) - log p_trainer(y_t | y_<t) |

with a bound tied to the dtypes: 1e-3 when trainer and engine both compute in fp32, 5e-2 when either side computes
in bf16 or fp16 (`--sync_logprob_tolerance` overrides; 0 turns the check off). Measured here (see docs/rl.md): the
tiny test models agree to ~1e-6 in fp32 and SmolLM2-135M to ~1e-5; a mixture-of-experts engine whose reloaded expert
weights were left in the wrong kernel layout was off by 1.2e-2, a stale tied `lm_head` by ~0.1. A diff over the bound
stops the run naming the engine, the diff, the bound and the dtypes.

What it cannot see: a sync that never happened after a tiny update (at lr 1e-6 one step moves the log-probs less
than any bound); the names check and `sync/bytes` cover that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rlhfkit.config.commands import PPOConfig
from rlhfkit.errors import WeightSyncMismatch

log = logging.getLogger("rlhfkit")

FP32_BOUND = 1e-3
HALF_BOUND = 5e-2
PROBE_PROMPT_TOKENS = 48
PROBE_RESPONSE_TOKENS = 16


def default_bound(trainer_dtype: str, engine_dtype: str) -> float:
    """The mean |Δ log p| allowed between an engine and the trainer computing in these dtypes."""
    return FP32_BOUND if trainer_dtype == engine_dtype == "fp32" else HALF_BOUND


@dataclass
class SyncCheck:
    prompt_ids: list[int]
    response_ids: list[int]
    bound: float           # 0: off
    dtypes: str            # "trainer fp32, engine fp32" (for the error)

    @classmethod
    def from_run(cls, prompts: list[dict], cfg: PPOConfig) -> SyncCheck:
        """The probe from the run's first two prompts, cut to fit the engines' context (--prompt_max_len +
        --generate_max_len)."""
        room = cfg.prompt_max_len + cfg.generate_max_len
        response = list(prompts[1 % len(prompts)]["prompt_ids"][:PROBE_RESPONSE_TOKENS])
        response = response[:max(1, room // 2)]
        prompt = list(prompts[0]["prompt_ids"][:min(PROBE_PROMPT_TOKENS, room - len(response))])
        tolerance = cfg.sync_logprob_tolerance
        bound = default_bound(cfg.param_dtype, cfg.vllm_dtype) if tolerance is None else tolerance
        return cls(prompt, response, bound, f"trainer {cfg.param_dtype}, engine {cfg.vllm_dtype}")

    def check(self, actor: Any, engines: list[Any], when: str) -> dict[str, float]:
        """Score the probe on every engine and on the actor; raise `WeightSyncMismatch` over the bound. Returns
        sync/logprob_diff (the largest engine's mean diff) and sync/logprob_diff_max (largest token diff)."""
        from rlhfkit.rollout.remote import wait_remote

        if self.bound == 0:
            return {}
        pending = [e.score.remote([self.prompt_ids], [self.response_ids]) for e in engines]
        trainer = actor.call("probe_log_probs", self.prompt_ids, self.response_ids)[0]
        worst, worst_token = 0.0, 0.0
        for k, (scored,) in enumerate(wait_remote(pending, role="engine", method="score", handles=engines)):
            diffs = [abs(a - b) for a, b in zip(scored, trainer, strict=True)]
            mean = sum(diffs) / len(diffs)
            if not mean <= self.bound:  # NaN fails too
                raise WeightSyncMismatch(
                    f"{when}: rollout engine {k} of {len(engines)} computes log-probs that differ from the trainer's "
                    f"by {mean:.3g} on average (largest token {max(diffs):.3g}) over a {len(diffs)}-token probe; the "
                    f"bound for {self.dtypes} is {self.bound:g}. The engine did not load the weights the trainer "
                    "holds (a layout, name or dtype the engine reads differently), so its samples would come from "
                    "another model. Set --sync_logprob_tolerance to change the bound (0 turns the check off).")
            worst, worst_token = max(worst, mean), max(worst_token, max(diffs))
        return {"sync/logprob_diff": worst, "sync/logprob_diff_max": worst_token}
