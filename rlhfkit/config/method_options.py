"""Option groups of the offline preference / distillation / process-reward commands.

One group per command (`rlhfkit rm|dpo|kto|kd|prm`), listed FIRST in the command's groups so that its
defaults (OpenRLHF's, from ../shared/FLAGS.md) override those of the common groups. Differences from OpenRLHF
are stated in the help text.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt

REF_MODES = ["precompute", "live"]


@dataclass
class RMOptions:
    """Reward model"""

    learning_rate: float = opt(9e-6, "peak learning rate")
    micro_train_batch_size: int = opt(1, "pairs per forward/backward per rank (each pair is 2 sequences)")
    max_len: int = opt(512, "maximum tokens per side of a pair")
    prompt_key: str | None = opt(None, "key of the prompt; unset: chosen/rejected are whole texts or conversations")
    chosen_key: str = opt("chosen", "key of the preferred response (or conversation)")
    rejected_key: str = opt("rejected", "key of the dispreferred response (or conversation)")
    loss: str = opt("sigmoid", "pairwise loss: sigmoid = -log sigmoid(r_c - r_r), logexp = log(1 + exp(r_r - r_c))",
                    choices=["sigmoid", "logexp"])
    margin_loss: bool = opt(False, "subtract the row's margin (--margin_key) inside the pairwise loss")
    margin_key: str = opt("margin", "key of the per-pair margin read with --margin_loss (OpenRLHF reads 'margin')")
    compute_fp32_loss: bool = opt(True, "the reward-model loss is computed in float32 (always: the head's values "
                                        "are cast before the pairwise loss); --no-compute_fp32_loss is refused")
    value_head_prefix: str = opt("score", "name of the scalar head (rlhfkit's heads are always 'score', the "
                                          "AutoModelForSequenceClassification name)", choices=["score"])


@dataclass
class DPOOptions:
    """DPO / IPO / cDPO"""

    learning_rate: float = opt(1e-5, "peak learning rate")
    max_len: int = opt(512, "maximum tokens per side of a pair")
    beta: float = opt(0.1, "DPO temperature beta (IPO: the target margin is 1 / (2 beta))")
    label_smoothing: float = opt(0.0, "cDPO: probability that a preference label is flipped, in [0, 0.5)")
    ipo: bool = opt(False, "IPO loss (h - 1/(2 beta))^2 on length-averaged log-probs")
    nll_loss_coef: float = opt(0.0, "add this times the chosen responses' token-mean NLL (RPO-style)")
    ref_pretrain: str | None = opt(None, "reference model (default: --pretrain)")
    ref_mode: str = opt("precompute", "precompute: reference log-probs of the whole dataset once before training, "
                                      "then the reference is freed; live: reference forward beside the policy on "
                                      "every micro-batch (see docs/methods.md for the measurement)", choices=REF_MODES)
    ref_offload: bool = opt(False, "live mode: keep the reference's parameters on CPU between forwards "
                                   "(FSDP2 CPUOffloadPolicy, CUDA only)")
    prompt_key: str | None = opt(None, "key of the prompt; unset: chosen/rejected are whole texts or conversations")
    chosen_key: str = opt("chosen", "key of the preferred response (or conversation)")
    rejected_key: str = opt("rejected", "key of the dispreferred response (or conversation)")


@dataclass
class KTOOptions:
    """KTO"""

    learning_rate: float = opt(1e-5, "peak learning rate")
    beta: float = opt(0.01, "KTO beta")
    desirable_loss_weight: float = opt(1.0, "lambda_D: weight of desirable (label true) samples")
    undesirable_loss_weight: float = opt(1.0, "lambda_U: weight of undesirable (label false) samples")
    label_key: str = opt("label", "key of the boolean label (true: desirable)")
    input_template: str | None = opt("User: {}\nAssistant: ", "template with one {} for the prompt "
                                                               "(ignored with --apply_chat_template)")
    ref_pretrain: str | None = opt(None, "reference model (default: --pretrain; OpenRLHF always uses --pretrain)")
    ref_mode: str = opt("precompute", "precompute or live reference log-probs (as for rlhfkit dpo)",
                        choices=REF_MODES)
    ref_offload: bool = opt(False, "live mode: keep the reference's parameters on CPU between forwards (CUDA only)")


@dataclass
class KDOptions:
    """Knowledge distillation"""

    learning_rate: float = opt(5e-6, "peak learning rate")
    teacher_model: str | None = opt(None, "teacher model (same tokenizer/vocabulary as --pretrain)")
    kd_coef: float = opt(0.4, "loss = (1 - kd_coef) * SFT NLL + kd_coef * KL(teacher || student), token means")
    teacher_offload: bool = opt(False, "keep the teacher's parameters on CPU between forwards (CUDA only)")
    output_key: str | None = opt("output", "key of the response")
    input_template: str | None = opt("User: {}\nAssistant: ", "template with one {} for the prompt "
                                                               "(ignored with --apply_chat_template)")
    pretrain_mode: bool = opt(False, "loss on all tokens (continued pretraining)")


@dataclass
class PRMOptions:
    """Process reward model"""

    learning_rate: float = opt(1e-6, "peak learning rate")
    micro_train_batch_size: int = opt(1, "samples per forward/backward per rank")
    placeholder_token: str | None = opt(None, "the token that marks the end of each step in --input_key text, e.g. "
                                              "'ки' (must be one token; the text is split on it)")
    reward_tokens: list[str] | None = opt(None, "the label classes, good first, e.g. '+ -'; the loss is a softmax "
                                                "over these tokens only (unset: the whole vocabulary)")
    label_key: str = opt("label", "key of the per-step labels: a list with one entry per placeholder, each a reward "
                                  "token string (hard), a bool (true = the first reward token) or a probability that "
                                  "the step is good (soft)")
    input_template: str | None = opt(None, "template with one {} for the input text")
