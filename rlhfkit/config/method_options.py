"""Option groups of the offline preference / distillation / process-reward commands.

One group per command (`rlhfkit rm|dpo|kto|kd|prm`) with the flags only that command has, and the small groups
two of them share (preference keys: rm, dpo; reference model: dpo, kto, ppo). Each flag is declared once; a
command's own default (OpenRLHF's, from ../shared/FLAGS.md) is in rlhfkit.config.commands.COMMAND_DEFAULTS.
Differences from OpenRLHF are stated in the help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt

REF_MODES = ["precompute", "live"]


@dataclass
class PreferenceKeyOptions:
    """Preference pairs"""

    prompt_key: str | None = opt(None, "key of the prompt; unset: chosen/rejected are whole texts or conversations")
    chosen_key: str = opt("chosen", "key of the preferred response (or conversation)")
    rejected_key: str = opt("rejected", "key of the dispreferred response (or conversation)")


@dataclass
class RefPretrainOptions:
    """Reference model"""

    ref_pretrain: str | None = opt(None, "reference model (default: --pretrain)",
                                   command_help={"kto": "reference model (default: --pretrain; OpenRLHF always uses "
                                                        "--pretrain)"})


@dataclass
class ReferenceLogpOptions:
    """Reference log-probs and beta (dpo, kto)"""

    beta: float = opt(0.1, "DPO temperature beta (IPO: the target margin is 1 / (2 beta))",
                      command_help={"kto": "KTO beta"})
    ref_mode: str = opt("precompute", "precompute: reference log-probs of the whole dataset once before training, "
                                      "then the reference is freed; live: reference forward beside the policy on "
                                      "every micro-batch (see docs/methods.md for the measurement)", choices=REF_MODES)
    ref_offload: bool = opt(False, "live mode: keep the reference's parameters on CPU between forwards "
                                   "(FSDP2 CPUOffloadPolicy, CUDA only)")


@dataclass
class RMOptions:
    """Reward model"""

    loss: str = opt("sigmoid", "pairwise loss: sigmoid = -log sigmoid(r_c - r_r), logexp = log(1 + exp(r_r - r_c))",
                    choices=["sigmoid", "logexp"])
    margin_loss: bool = opt(False, "subtract the row's margin (--margin_key) inside the pairwise loss")
    margin_key: str = opt("margin", "key of the per-pair margin read with --margin_loss (OpenRLHF reads 'margin')")
    compute_fp32_loss: bool = opt(True, "the reward-model loss is computed in float32 (always: the head's values "
                                        "are cast before the pairwise loss); --no-compute_fp32_loss is refused")


@dataclass
class DPOOptions:
    """DPO / IPO / cDPO"""

    label_smoothing: float = opt(0.0, "cDPO: probability that a preference label is flipped, in [0, 0.5)")
    ipo: bool = opt(False, "IPO loss (h - 1/(2 beta))^2 on length-averaged log-probs")
    nll_loss_coef: float = opt(0.0, "add this times the chosen responses' token-mean NLL (RPO-style)")


@dataclass
class KTOOptions:
    """KTO"""

    desirable_loss_weight: float = opt(1.0, "lambda_D: weight of desirable (label true) samples")
    undesirable_loss_weight: float = opt(1.0, "lambda_U: weight of undesirable (label false) samples")
    vanilla_loss: bool = opt(False, "vanilla KTO (OpenRLHF's KTO trainer's --vanilla_loss, from ContextualAI "
                                    "HALOs): the reference point of a desirable sample is max(0, mean log-ratio of "
                                    "the micro-batch's undesirable samples) and vice versa, instead of the KL over "
                                    "mismatched pairs; no sample weights (docs/algorithms.md)")


@dataclass
class TeacherModelOptions:
    """Teacher model (kd, ppo)"""

    teacher_model: str | None = opt(None, "teacher model (same tokenizer/vocabulary as --pretrain)",
                                    command_help={"ppo": "on-policy distillation (--advantage_estimator "
                                                         "on_policy_distill): the frozen teacher that scores every "
                                                         "sampled token, loaded in the reference role "
                                                         "(--ref_num_nodes ...); same tokenizer as --pretrain, "
                                                         "checked at start; unset: --ref_pretrain (Molt's way)"})


@dataclass
class KDOptions:
    """Knowledge distillation"""

    kd_coef: float = opt(0.4, "loss = (1 - kd_coef) * SFT NLL + kd_coef * KL(teacher || student), token means")
    teacher_offload: bool = opt(False, "keep the teacher's parameters on CPU between forwards (CUDA only)")


@dataclass
class PRMOptions:
    """Process reward model"""

    placeholder_token: str | None = opt(None, "the token that marks the end of each step in --input_key text, e.g. "
                                              "'ки' (must be one token; the text is split on it)")
    reward_tokens: list[str] | None = opt(None, "the label classes, good first, e.g. '+ -'; the loss is a softmax "
                                                "over these tokens only (unset: the whole vocabulary)")
