"""`rlhfkit batch-inference`: generate with vLLM (or transformers), score, post-process (rejection sampling,
conditional SFT, iterative DPO). OpenRLHF's `batch_inference`."""

from __future__ import annotations

import json
from typing import Any

from rlhfkit.config.commands import BatchInferenceConfig
from rlhfkit.config.parse import parse_config

DESCRIPTION = ("Sample best_of_n responses per prompt on the rollout engines (--eval_task generate_vllm|generate) "
               "or read input/output rows (--eval_task rm), score them with reward models or functions, and write "
               "JSON lines; --post_processor rs|csft|iter_dpo turns them into SFT rows or DPO pairs.")
GROUPS = list(BatchInferenceConfig.GROUPS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from rlhfkit.inference.batch import run_batch_inference

    cfg = parse_config(BatchInferenceConfig, GROUPS, argv, DESCRIPTION)
    stats = run_batch_inference(cfg)
    print(json.dumps(stats))
    print(f"wrote {stats['rows_written']} rows to {cfg.output_path}")
    return stats


if __name__ == "__main__":
    main()
