"""Option groups of the reward sources, shared by ppo, batch-inference and serve-rm (and the value head, by rm too).

Each flag is declared once here; a command's own help, where the flag means something different there, is in the
field's `command_help`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt


@dataclass
class RewardSourceOptions:
    """Reward sources"""

    reward_pretrain: str | None = opt(None, "reward model(s), comma-separated",
                                      command_help={"batch-inference": "reward model(s) to score with, "
                                                                       "comma-separated (generate tasks: score right "
                                                                       "away)",
                                                    "serve-rm": "reward model(s), comma-separated (combined per "
                                                                "--reward_combine)"})
    remote_rm_url: str | None = opt(None, "reward source(s): http(s) URLs, a reward_func .py file, or builtin:NAME",
                                    command_help={"serve-rm": "a reward_func .py file or builtin:math|format|exact"})
    reward_timeout: float = opt(60.0, "seconds a reward function / remote RM may take per batch; builtin:code: "
                                      "each program run gets 5 s, or this where smaller (one over it scores 0)",
                                command_help={"serve-rm": "seconds per reward_func call (builtin:code: each program "
                                                          "run 5 s, or this where smaller)"})
    code_sandbox: str = opt("auto", "builtin:code's sandbox: namespaces (user+mount+net+pid namespaces, a fresh "
                                    "read-only root, no network), rlimit (limits only), auto: the strongest that "
                                    "works here", choices=["auto", "namespaces", "rlimit"])
    code_memory_mb: int = opt(512, "builtin:code: address space of a program run, MiB (RLIMIT_AS)")
    code_max_procs: int = opt(32, "builtin:code: processes of a program run (RLIMIT_NPROC; see docs/rewards.md for "
                                  "what it counts in each sandbox mode)")
    code_max_open_files: int = opt(64, "builtin:code: open files of a program run (RLIMIT_NOFILE)")
    code_max_file_mb: int = opt(16, "builtin:code: size of a file a program writes, MiB (RLIMIT_FSIZE; also each "
                                    "tmpfs of the namespaces sandbox)")
    code_max_output_kb: int = opt(1024, "builtin:code: KiB read of a program's stdout and of its results; more "
                                        "kills it (reward_failure output_limit)")
    normalize_reward: bool = opt(False, "reward models: (r - reward_mean) / reward_std with the statistics "
                                        "'rlhfkit rm' stored in their config.json")


@dataclass
class RewardCombineOptions:
    """Reward combination"""

    reward_error_policy: str = opt("raise", "raise: stop on a failing reward; zero: score it 0 and count it",
                                   choices=["raise", "zero"],
                                   command_help={"serve-rm": "a failing reward_func: raise (HTTP 422) or score the "
                                                             "sample 0"})
    reward_combine: str = opt("mean", "how several rewards (models and --remote_rm_url sources) combine per sample",
                              choices=["mean", "sum"])
    reward_weights: str | None = opt(None, "comma-separated weights, one per reward source (--reward_pretrain "
                                           "models first): r = sum_i w_i r_i, overrides --reward_combine")
    reward_format_pattern: str | None = opt(None, "regex of builtin:format (default <think>..</think><answer>..)")


@dataclass
class ValueHeadOptions:
    """Value head"""

    value_head_prefix: str = opt("score", "name of the scalar head of reward models (and ppo's critic); rlhfkit's "
                                          "heads are always 'score', the AutoModelForSequenceClassification name",
                                 choices=["score"])
