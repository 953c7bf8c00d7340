"""After the engines get weights (at start and after every sync): do they compute what the trainer computes?

The loaded-names check (`rlhfkit.rollout.worker_ext.check_every_parameter_loaded`) proves every engine parameter
was written; this check proves that what was written is what the engine computes with. Every engine (`score`,
temperature 1) and the actor (`probe_log_probs`, the forward the trainer uses) score the same fixed probe, and

    diff = mean over probe tokens | log p_engine(y_t | y_<t) - log p_trainer(y_t | y_<t) |

must stay under a bound. The probe (built once, at start): the run's first `PROBE_SEQUENCES` prompts, each followed
by `PROBE_RESPONSE_TOKENS` tokens that engine 0 samples from it at temperature 1 with a fixed seed - tokens the
policy itself emits. (The first version scored another prompt's tokens as the "response": unlikely tokens, where
bf16's absolute log-prob error is largest, over only 16 of them; SmolLM2-135M's bf16 noise then read 0.02-0.08 and
crossed a fixed 5e-2 bound on a correct sync.)

The bound (`bound_for`), calibrated in docs/rollout.md (benchmarks/sync_check_noise.py):
- both sides fp32: `FP32_BOUND` (1e-3), at start and after every sync. Noise: ~1e-6 (tiny) to ~1e-5 (135M).
- either side bf16/fp16: at start, when both sides compute from the same weights, `HALF_START_BOUND` (0.25):
  the noise is 5e-4 (tiny) to 0.045 (SmolLM2-135M); a matrix loaded in the wrong layout is 3.7-5.3 on the
  135M model. After start the bound is relative to the noise this run measured at start:
  max(`HALF_FLOOR`, `NOISE_FACTOR` x start diff), so a model whose bf16 noise is small keeps a tight bound (the
  tiny models: 0.01, where a wrong layout, a stale layer or a stale tied lm_head after an update are 0.04-0.2).
`--sync_logprob_tolerance` sets one bound for every check (0 turns the check off). A diff over the bound stops the
run naming the engine, the diff, the bound and how the bound was made.

What it cannot see: a fault smaller than the precision's own noise. In bf16 on SmolLM2-135M a layer left one
small update behind moves the probe by less than the bf16 noise (measured: 0.027 against 0.026); the names check
and `sync/bytes` cover a parameter that was never sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import RunPlan
from rlhfkit.errors import WeightSyncMismatch

log = logging.getLogger("rlhfkit")

FP32_BOUND = 1e-3
HALF_START_BOUND = 0.25
HALF_FLOOR = 1e-2
NOISE_FACTOR = 4.0
PROBE_SEQUENCES = 4
PROBE_PROMPT_TOKENS = 48
PROBE_RESPONSE_TOKENS = 16


def bound_for(trainer_dtype: str, engine_dtype: str, start_diff: float | None) -> tuple[float, str]:
    """(the mean |Δ log p| allowed between an engine and the trainer computing in these dtypes, how it was made).
    `start_diff`: the diff measured at start (None: this is the start check)."""
    if trainer_dtype == engine_dtype == "fp32":
        return FP32_BOUND, "the fp32 bound"
    if start_diff is None:
        return HALF_START_BOUND, "the start bound with bf16/fp16"
    bound = max(HALF_FLOOR, NOISE_FACTOR * start_diff)
    return bound, f"max({HALF_FLOOR:g}, {NOISE_FACTOR:g} x the {start_diff:.3g} measured at start) with bf16/fp16"


@dataclass
class SyncCheck:
    prompts: list[list[int]]           # the probe prompts (the response tokens are sampled at start)
    response_tokens: int
    seed: int
    tolerance: float | None            # --sync_logprob_tolerance: one bound for every check (0: off)
    trainer_dtype: str
    engine_dtype: str
    responses: list[list[int]] = field(default_factory=list)
    start_diff: float | None = None    # the worst engine's diff at the first check
    one_at_a_time: bool = False        # the engines score before the trainer does (they share a CPU's cores)

    @classmethod
    def from_run(cls, prompts: list[dict], cfg: PPOConfig, plan: RunPlan | None = None) -> SyncCheck:
        """The probe prompts from the run's first prompts, cut to fit the engines' context (--prompt_max_len +
        --generate_max_len, at most --max_len) with room for the sampled response; the trainer and engine dtypes are
        the run plan's (resolved), else the flags'."""
        from rlhfkit.config.rl_options import context_len

        room = context_len(cfg.prompt_max_len, cfg.generate_max_len, cfg.max_len)
        response_tokens = max(1, min(PROBE_RESPONSE_TOKENS, cfg.generate_max_len, room // 2))
        keep = min(PROBE_PROMPT_TOKENS, room - response_tokens)
        probe = [list(p["prompt_ids"][-keep:]) for p in prompts[:PROBE_SEQUENCES]]
        dtypes = (plan.trainer_dtype, plan.engine_dtype) if plan is not None else (cfg.param_dtype, cfg.vllm_dtype)
        on_cpu = plan is not None and plan.precision is not None and plan.precision.device == "cpu"
        return cls(probe, response_tokens, cfg.seed, cfg.sync_logprob_tolerance, *dtypes, one_at_a_time=on_cpu)

    @property
    def off(self) -> bool:
        return self.tolerance == 0

    def bound(self) -> tuple[float, str]:
        if self.tolerance is not None:
            return self.tolerance, "--sync_logprob_tolerance"
        return bound_for(self.trainer_dtype, self.engine_dtype, self.start_diff)

    def sample_responses(self, engine: Any) -> None:
        """The probe's response tokens: `response_tokens` tokens engine 0 samples after each probe prompt."""
        from rlhfkit.rollout.remote import wait_remote
        from rlhfkit.rollout.types import SamplingConfig

        sampling = SamplingConfig(temperature=1.0, max_new_tokens=self.response_tokens, n=1, seed=self.seed,
                                  ignore_eos=True)
        (samples,) = wait_remote([engine.generate.remote(self.prompts, sampling)], role="engine",
                                 method="generate", handles=[engine])
        self.responses = [list(s.response_ids) for s in samples]

    def compare(self, engine_scores: list[list[list[float]]], trainer_scores: list[list[float]],
                when: str) -> dict[str, float]:
        """Check each engine's scores ([engine][sequence][token]) against the trainer's ([sequence][token]);
        raise `WeightSyncMismatch` over the bound. The first call records the start diff."""
        bound, made = self.bound()
        trainer = [x for seq in trainer_scores for x in seq]
        worst, worst_token = 0.0, 0.0
        for k, scored in enumerate(engine_scores):
            diffs = [abs(a - b) for a, b in zip([x for seq in scored for x in seq], trainer, strict=True)]
            mean = sum(diffs) / len(diffs)
            if not mean <= bound:  # NaN fails too
                raise WeightSyncMismatch(
                    f"{when}: rollout engine {k} of {len(engine_scores)} computes log-probs that differ from the "
                    f"trainer's by {mean:.3g} on average (largest token {max(diffs):.3g}) over a {len(diffs)}-token "
                    f"probe; the bound (trainer {self.trainer_dtype}, engine {self.engine_dtype}) is {bound:.3g}: "
                    f"{made}. The engine did not load the weights the trainer holds (a layout, name or dtype the "
                    "engine reads differently), so its samples would come from another model. Set "
                    "--sync_logprob_tolerance to change the bound (0 turns the check off).")
            worst, worst_token = max(worst, mean), max(worst_token, max(diffs))
        if self.start_diff is None:
            self.start_diff = worst
        return {"sync/logprob_diff": worst, "sync/logprob_diff_max": worst_token, "sync/logprob_bound": bound}

    def check(self, actor: Any, engines: list[Any], when: str) -> dict[str, float]:
        """Score the probe on every engine and on the actor and `compare`. Returns sync/logprob_diff (the worst
        engine's mean diff), sync/logprob_diff_max (its largest token diff) and sync/logprob_bound."""
        from rlhfkit.rl.worker import ModelWorker
        from rlhfkit.rollout.remote import wait_remote

        if self.off:
            return {}
        if not self.responses:
            self.sample_responses(engines[0])
        # On GPUs the engines and the trainer score at the same time. On a CPU they would compete for the same cores,
        # each process with as many threads as there are cores: one after the other is faster (the demo's check,
        # AMD EPYC Zen 5 with native bf16, median of 14 steps: 0.30 s against 0.34 s at the same time).
        pending = [e.score.remote(self.prompts, self.responses) for e in engines]
        if self.one_at_a_time:
            scored = wait_remote(pending, role="engine", method="score", handles=engines)
            trainer = actor.call(ModelWorker.probe_log_probs, self.prompts, self.responses)[0]
        else:
            trainer = actor.call(ModelWorker.probe_log_probs, self.prompts, self.responses)[0]
            scored = wait_remote(pending, role="engine", method="score", handles=engines)
        return self.compare(list(scored), trainer, when)
