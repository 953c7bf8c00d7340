"""One rank of the gloo check in test_tensor_parallel.py (run as a script, not collected by pytest).

argv: rank world_size tp_size store_file model_dir output_file. For a tiny Llama (tied embeddings, 2 heads), a tiny
Qwen2 (grouped-query attention: 4 query heads, 2 key/value heads, q/k/v biases, untied LM head) and a tiny Llama
reward model, every rank builds the same weights and (rank 0) computes the unsharded reference: the loss, every
parameter gradient, the clipped global gradient norm and the weights after one AdamW step (plain torch, no
rlhfkit engine). Then all ranks build a TrainEngine on the ("dp", "tp") mesh, each data-parallel group on its share
of the batch, and record the same quantities (DTensors gathered with full_tensor); plus the full state dict that
a saved HF checkpoint receives. Results go to output_file with torch.save.
"""

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

from rlhfkit.data.collate import collate_padded, model_inputs
from rlhfkit.engine.checkpoint import full_state_dict
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.models import tensor_parallel as tp
from rlhfkit.models.loading import head_values, load_causal_lm
from rlhfkit.trainers.common import target_log_probs

LR, MAX_NORM, EPS = 1e-2, 0.5, 1e-6  # eps 1e-6: Adam's first step lr g / (|g| + eps) stays smooth
CFG = SimpleNamespace(gradient_checkpointing=False, zero_stage=3, param_dtype="fp32", adam_offload=False,
                      aux_loss_coef=0.0, learning_rate=LR, adam_betas=[0.9, 0.95], l2=0.1, lr_warmup_ratio=0.0,
                      lr_scheduler="constant", min_lr_ratio=0.0, max_norm=MAX_NORM, optim="adam", adam_eps=EPS,
                      muon_lr=0.02, muon_momentum=0.95, muon_ns_steps=5, muon_nesterov=True)


def samples(count: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in [9, 4, 12, 7][:count]:
        ids = torch.randint(5, 120, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0, 0] + [1] * (n - 2)})
    return out


def sft_loss(model, batch, tokens: float) -> torch.Tensor:
    log_probs, mask = target_log_probs(model, batch)
    return -(log_probs * mask).sum() / tokens


def value_loss(model, batch, tokens: float) -> torch.Tensor:
    """A smooth function of every real token's reward-head value (a weighted sum)."""
    values = head_values(model, **model_inputs(batch))
    weights = torch.cos(torch.arange(values.shape[1], dtype=values.dtype))[None]  # by position, not by width
    return (values * weights * batch["attention_mask"]).sum() / tokens


def build(name: str, model_dir: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return load_causal_lm(model_dir)
    if name == "qwen2":
        config = Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                             max_position_embeddings=64)
        return Qwen2ForCausalLM(config)
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels, config.pad_token_id = 1, 0
    return LlamaForSequenceClassification(config)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def reference(name: str, model_dir: str, loss_fn) -> dict:
    """The unsharded step: loss, gradients, clipped norm, weights after one AdamW step (plain torch)."""
    model = build(name, model_dir)
    batch = collate_padded(samples(), pad_token_id=0)
    tokens = float(batch["loss_mask"][:, 1:].sum())
    loss = loss_fn(model, batch, tokens)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    matrices = [p for p in model.parameters() if p.ndim >= 2]  # rlhfkit's AdamW: no decay on biases and norms
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    opt.step()
    return {"loss": loss.detach(), "grads": grads, "norm": float(norm),
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def sharded(name: str, model_dir: str, loss_fn, rank: int, world: int, size: int) -> dict:
    """The same step through TrainEngine on the (dp, tp) mesh: data-parallel group k takes samples k::dp."""
    group = tp.setup_tensor_parallel(size)
    dp_rank, dp_world = rank // size, world // size
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    engine = TrainEngine(build(name, model_dir), CFG, info, total_steps=4)
    full_batch = collate_padded(samples(), pad_token_id=0)
    tokens = float(full_batch["loss_mask"][:, 1:].sum())
    batch = collate_padded(samples()[dp_rank::dp_world], pad_token_id=0)
    loss = loss_fn(engine.model, batch, tokens) * dp_world  # FSDP2 averages the gradients over the dp ranks
    loss.backward()
    grads = {n: full(p.grad) for n, p in engine.model.named_parameters()}
    norm = engine.optimizer_step()
    total = loss.detach() / dp_world
    dist.all_reduce(total)
    out = {"loss": total / size, "grads": grads, "norm": norm, "group": group.size,
           "weights": {n: full(p) for n, p in engine.model.named_parameters()},
           "state": full_state_dict(engine.model)}
    tp.teardown_tensor_parallel()
    return out


def main() -> None:
    rank, world, size, store_file, model_dir, output_file = sys.argv[1:7]
    rank, world, size = int(rank), int(world), int(size)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    cases = {"llama": sft_loss, "qwen2": sft_loss, "rm": value_loss}
    results: dict = {"reference": {}, "tp": {}}
    for name, loss_fn in cases.items():
        if rank == 0:
            results["reference"][name] = reference(name, model_dir, loss_fn)
        results["tp"][name] = sharded(name, model_dir, loss_fn, rank, world, size)
    dist.barrier()
    torch.save(results, output_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
