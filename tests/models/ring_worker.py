"""One rank of the 2-process gloo check in test_context_parallel.py (run as a script, not collected by pytest).

argv: rank world_size store_file model_dir output_file. Each rank computes, for padded and packed batches, the SFT
loss, the reward-model head values and the KD loss with --ring_attn_size 2 (each rank one half of the sequence),
their gradients summed over the ranks, and (rank 0) the same with an unsharded forward of the same weights; results go
to output_file with torch.save.
"""

import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhfkit.data.collate import collate_packed, collate_padded, model_inputs
from rlhfkit.models import context_parallel as cp
from rlhfkit.models.loading import head_values, load_causal_lm
from rlhfkit.trainers.common import target_log_probs
from rlhfkit.trainers.kd import kd_batch_loss

TEACHER: dict = {}  # the KD teacher (a second random model of the student's architecture)


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    lengths = [9, 4, 12]  # uneven; packed total 25 (odd: the ring pads it to 26), padded width 12
    out = []
    for n in lengths:
        ids = torch.randint(5, 120, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0, 0] + [1] * (n - 2)})
    return out


def batches() -> dict[str, dict]:
    s = samples()
    return {"padded": collate_padded(s, pad_token_id=0), "packed": collate_packed(s)}


def sft_loss(model, batch) -> torch.Tensor:
    log_probs, mask = target_log_probs(model, batch)
    return -(log_probs * mask).sum() / mask.sum()


def kd_loss(model, batch) -> torch.Tensor:
    """`rlhfkit kd`'s mixed loss (NLL and KL to the teacher, kd_coef 0.5) per target token."""
    return kd_batch_loss(model, TEACHER["model"], batch, kd_coef=0.5)[0] / batch["loss_mask"][:, 1:].sum()


def value_loss(model, batch) -> torch.Tensor:
    """Any smooth function of every real token's value (a weighted sum), so head-value gradients are compared."""
    values = head_values(model, **model_inputs(batch))
    weights = torch.linspace(-1, 1, values.shape[1])[None]
    real = batch["attention_mask"] if "attention_mask" in batch else torch.ones_like(values)
    return (values * weights * real).sum()


def run(model, loss_fn, batch, ring_size: int) -> dict:
    """Loss and parameter gradients; with a ring the gradients are summed over the ranks and divided by the ring
    size (each rank's replicated loss sends the gradient back N-fold: the training loop's normaliser cancels it)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if ring_size > 1:
            dist.all_reduce(g)
            g /= ring_size
        grads[name] = g
    return {"loss": loss.detach(), "grads": grads}


def models(model_dir: str) -> dict:
    torch.manual_seed(0)
    gqa = AutoConfig.from_pretrained(model_dir)
    gqa.num_key_value_heads = 1  # grouped-query attention: 2 query heads share one key/value head
    gqa.vocab_size = 128
    rm = AutoConfig.from_pretrained(model_dir)
    rm.num_labels, rm.vocab_size = 1, 128
    TEACHER["model"] = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    return {"lm": load_causal_lm(model_dir), "gqa": LlamaForCausalLM(gqa),
            "rm": LlamaForSequenceClassification(rm), "kd": load_causal_lm(model_dir)}


def main() -> None:
    rank, world, store_file, model_dir, output_file = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    nets = models(model_dir)
    cases = [("lm", sft_loss, 1), ("lm", sft_loss, 2), ("gqa", sft_loss, 1), ("rm", value_loss, 1),
             ("kd", kd_loss, 1)]
    results: dict = {"reference": {}, "ring": {}, "ring_attn_size": world}
    for name, loss_fn, _ in cases:
        for layout, batch in batches().items():
            results["reference"][(name, layout)] = run(nets[name], loss_fn, batch, 1)
    for name, loss_fn, stride in cases:
        cp.setup_ring_attention(results["ring_attn_size"], head_stride=stride)
        ringed = [nets[name]] + ([TEACHER["model"]] if name == "kd" else [])
        for net in ringed:
            cp.use_ring_attention(net)
        for layout, batch in batches().items():
            results["ring"][(name, layout, stride)] = run(nets[name], loss_fn, batch, world)
        for net in ringed:
            net.set_attn_implementation("sdpa")
        cp.teardown_ring_attention()
    try:  # a head stride that does not divide the key/value heads is refused, naming the flag
        cp.setup_ring_attention(world, head_stride=3)
        cp.use_ring_attention(nets["lm"])
    except Exception as err:  # noqa: BLE001 - the message is checked by the test
        results["bad_stride"] = str(err)
    dist.barrier()
    torch.save(results, output_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
