"""`rlhfkit lora-merge`: merge a LoRA adapter folder into its base model (OpenRLHF's `lora_combiner`)."""

from __future__ import annotations

import argparse
import sys

import torch

from rlhfkit.errors import ConfigError

DESCRIPTION = ("Merge a LoRA adapter folder (what `--lora_rank N --save_path DIR` writes) into its base model and "
               "write a plain HF folder that from_pretrained and vLLM load. The adapter's task_type picks a causal "
               "LM or a scalar (score-head) model.")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="rlhfkit lora-merge", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pretrain", "--model_path", dest="pretrain", required=True,
                        help="the base model the adapter was trained on (folder, hub name, .gguf, embedded:...)")
    parser.add_argument("--lora_path", required=True, help="the adapter folder (adapter_config.json inside)")
    parser.add_argument("--output_path", required=True, help="where the merged HF folder goes")
    parser.add_argument("--param_dtype", default="fp32", choices=sorted(_DTYPES), help="dtype of the merged weights")
    return parser


def main(argv: list[str] | None = None) -> str:
    from rlhfkit.config.dialect import rewrite_argv
    from rlhfkit.models.lora import merge_lora

    parser = build_parser()  # OpenRLHF's dotted names (--ds.param_dtype) -> ours
    args = parser.parse_args(rewrite_argv("lora-merge", list(sys.argv[1:] if argv is None else argv), parser,
                                          lambda name: None))
    try:
        out = merge_lora(args.pretrain, args.lora_path, args.output_path, dtype=_DTYPES[args.param_dtype])
    except FileNotFoundError as err:
        raise ConfigError(f"--lora_path {args.lora_path}: {err}") from None
    print(out)
    return out


if __name__ == "__main__":
    main()
