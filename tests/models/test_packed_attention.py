"""Packed rows attended block by block (`rlhfkit.models.packed_attention`): both block layouts must give what the
dense ``[L, L]`` mask gives (outputs and gradients, float64), whichever layout the cost estimate picks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import rlhfkit.models.packed_attention as packed_attention_module
from rlhfkit.models.loading import load_causal_lm
from rlhfkit.models.packed_attention import (
    FP32_ATTENTION_MAX_WIDTH,
    PACKED_SDPA,
    PackedAttention,
    attend_in_matmuls,
    causal_rows,
    masked_blocks,
    packed_sdpa_forward,
    shared_prompts,
    use_packed_attention,
    uses_packed_attention,
)
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import build_experience, trim_padding
from rlhfkit.rl.packing import PackedRollout, allowed_keys, pack_rollout, pack_rows, packed_response_log_probs

# prompt A's rows come before and after prompt B's, so group A's tokens are not contiguous in the packed row;
# one response is empty
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [5, 6, 7, 8, 9], [13, 14, 15], [11, 12], [5, 6, 7, 8, 9]]
RESPONSES = [[20, 21, 22], [29, 30], [24, 25, 26, 27, 28], [31, 32, 33, 34], [], [23]]


def layouts_of(packed: PackedRollout) -> dict[str, PackedAttention]:
    """Both block layouts of `packed`, built here from its group/segment tensors (independently of pack_rows)."""
    group, segment = packed.group, packed.segment
    length = len(group)
    rows, blocks, prompts, responses = [], [], [], []
    for g in range(int(group.max()) + 1):
        in_group = (group == g).nonzero().flatten()
        prompt = in_group[segment[in_group] == -1].tolist()
        blocks.append(in_group.tolist())
        prompts.append(prompt)
        for r in sorted(set(segment[in_group].tolist()) - {-1}):
            rows.append(prompt + (segment == r).nonzero().flatten().tolist())
            responses.append((g, (segment == r).nonzero().flatten().tolist()))

    def between(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # the dense mask's rows q, columns k
        return allowed_keys(group, segment)[q][:, k]

    return {"causal rows": causal_rows(rows, length),
            "masked blocks": masked_blocks(blocks, lambda pos: allowed_keys(group[pos], segment[pos]), length),
            "shared prompts": shared_prompts(prompts, responses, between, length)}


def test_each_layout_equals_the_dense_mask_on_random_heads_with_grouped_keys():
    """The attention function itself: [1, H, L, D] queries against H_kv = H / 2 key/value heads, float64, outputs
    and the gradients of query, key and value, against SDPA under the packed row's dense boolean mask."""
    packed = pack_rows(PROMPTS, RESPONSES, 5)
    length = packed.num_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, length, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, length, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, length, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.randn(1, length, 4, 8, dtype=torch.float64, generator=g)
    allowed = allowed_keys(packed.group, packed.segment)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None], enable_gqa=True).transpose(1, 2)
    expected = [dense.detach(), *torch.autograd.grad((dense * weights).sum(), (q, k, v))]
    assert expected[0].abs().sum() > 1 and all(t.abs().sum() > 1e-3 for t in expected[1:])
    for kind, layout in layouts_of(packed).items():
        assert layout.kind == kind
        out, _ = packed_sdpa_forward(torch.nn.Module(), q, k, v, None, scaling=8 ** -0.5, packed_attention=layout)
        got = [out.detach(), *torch.autograd.grad((out * weights).sum(), (q, k, v))]
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m, n=name, kd=kind: f"{kd} {n}: {m}")


@pytest.mark.parametrize("width", [FP32_ATTENTION_MAX_WIDTH, FP32_ATTENTION_MAX_WIDTH + 1])
def test_narrow_bf16_blocks_attend_in_fp32_and_wide_ones_in_bf16(width, monkeypatch):
    """Where bf16 blocks do not attend in matmuls (here: none do), on a CPU a bf16 block of at most
    FP32_ATTENTION_MAX_WIDTH tokens is attended in float32 (the CPU kernel is faster there) and its output rounded to
    bf16: bit for bit SDPA on the upcast inputs, and no further from the float64 attention than the bf16 kernel; a
    wider block goes through the bf16 kernel, bit for bit."""
    monkeypatch.setattr(packed_attention_module, "MATMUL_ATTENTION_MAX_SCORES", 0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, width, 16, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    layout = causal_rows([range(width)], width)  # one causal block: the packed row itself
    out, _ = packed_sdpa_forward(torch.nn.Module(), q, k, v, None, packed_attention=layout)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))

    def sdpa(dtype: torch.dtype) -> list[torch.Tensor]:
        ref = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                                             enable_gqa=True).to(q.dtype if dtype != torch.float64 else dtype)
        ref = ref.transpose(1, 2)
        return [ref.detach(), *torch.autograd.grad(ref.float().square().sum(), (q, k, v))]
    narrow = width <= FP32_ATTENTION_MAX_WIDTH
    expected = sdpa(torch.float32 if narrow else torch.bfloat16)
    for name, a, b in zip(("output", "dq", "dk", "dv"), [out.detach(), *grads], expected):
        assert torch.equal(a, b), f"{name}: not the {'fp32' if narrow else 'bf16'} kernel's result"
    exact = sdpa(torch.float64)[0]
    if narrow:
        bf16_error = (sdpa(torch.bfloat16)[0].double() - exact).abs().mean()
        assert (out.detach().double() - exact).abs().mean() <= bf16_error


def _attention_case(causal: bool, common: float) -> tuple[torch.Tensor, ...]:
    """bf16 q [3, 6, 12, 16], k/v [3, 2, W, 16] (3 query heads per key-value head), scores of a few units, values on a
    grid of 1/8 with `common` added to every key's (the large shared part of a first layer's values; exact in bf16
    for `common` = 16), and a random mask in which every query sees its first key (causal: None, W = 12; else W = 20).
    """
    g = torch.Generator().manual_seed(3)
    width = 12 if causal else 20
    q = (torch.randn(3, 6, 12, 16, generator=g) * 1.5).bfloat16()
    k = (torch.randn(3, 2, width, 16, generator=g) * 1.5).bfloat16()
    v = ((torch.randn(3, 2, width, 16, generator=g) * 8).round().clamp(-31, 31) / 8 + common).bfloat16()
    allowed = None
    if not causal:
        allowed = torch.rand(3, 1, 12, width, generator=g) < 0.6
        allowed[..., 0] = True
    return q, k, v, allowed


def _attention_and_grads(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaf_dtype: torch.dtype,
                         ) -> list[torch.Tensor]:
    """fn's output and dq, dk, dv (float64) for a fixed output gradient, the inputs as leaves of `leaf_dtype`."""
    leaves = [t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).bfloat16().to(out.dtype)
    return [t.detach().double() for t in (out, *torch.autograd.grad(out, leaves, grad_out))]


def _relative_error(t: torch.Tensor, ref: torch.Tensor) -> float:
    return float((t - ref).abs().mean() / ref.abs().mean())


def _sdpa(dtype: torch.dtype, allowed: torch.Tensor | None):
    return lambda q, k, v: F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=allowed,
                                                          is_causal=allowed is None, enable_gqa=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("common", [0.0, 16.0])
def test_bf16_attention_in_matmuls_is_within_2x_of_the_fp32_kernels_error(causal, common):
    """`attend_in_matmuls` (bf16 blocks on a CPU with native bf16) against SDPA in float64: output and dq, dk, dv
    (mean relative error) within 2x of SDPA's on the inputs upcast to fp32, whose only error is rounding to bf16.
    Measured: 1.1x-1.8x; with values that share a large part (`common` = 16) the bf16 kernel is 36x-45x off in dq
    and dk, and so is this attention (18x-24x) if its weights do not sum to one."""
    q, k, v, allowed = _attention_case(causal, common)
    exact = _attention_and_grads(_sdpa(torch.float64, allowed), q, k, v, torch.float64)
    ours = _attention_and_grads(lambda a, b, c: attend_in_matmuls(a, b, c, allowed, 0.25), q, k, v, torch.bfloat16)
    upcast = _attention_and_grads(lambda a, b, c: _sdpa(torch.float32, allowed)(a, b, c).bfloat16(), q, k, v,
                                  torch.bfloat16)
    assert ours[0].shape == (3, 6, 12, 16)
    for name, mine, fp32, ref in zip(("output", "dq", "dk", "dv"), ours, upcast, exact):
        assert _relative_error(mine, ref) <= 2 * _relative_error(fp32, ref), \
            f"{name}: {_relative_error(mine, ref):.2e} against the fp32 kernel's {_relative_error(fp32, ref):.2e}"


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_attention_in_matmuls_gradients_ignore_a_part_common_to_all_values(causal):
    """Adding the same vector to every value shifts the output by it and leaves dq and dk as they were (the weights
    sum to one): through `attend_in_matmuls` they move by at most 1e-3 of their size (measured: under 3e-5; 2.6e-2 to
    3.4e-2 where the weights do not sum to one, and in SDPA's bf16 kernel 5e-2)."""
    q, k, v, allowed = _attention_case(causal, 0.0)
    shifted = _attention_case(causal, 16.0)[2]

    def grads(values: torch.Tensor) -> list[torch.Tensor]:
        return _attention_and_grads(lambda a, b, c: attend_in_matmuls(a, b, c, allowed, 0.25), q, k, values,
                                    torch.bfloat16)
    plain, moved = grads(v), grads(shifted)
    for name, i in (("dq", 1), ("dk", 2)):
        assert _relative_error(moved[i], plain[i]) <= 1e-3, f"{name}: {_relative_error(moved[i], plain[i]):.2e}"


def test_bf16_packed_blocks_attend_in_matmuls_up_to_the_score_bound(monkeypatch):
    """A bf16 call of at most MATMUL_ATTENTION_MAX_SCORES scores goes through `attend_in_matmuls` where the CPU
    computes bf16 natively (forced here, so every machine checks the route), a bigger one through SDPA on the upcast
    blocks; on a CPU without native bf16 every call goes to SDPA."""
    monkeypatch.setattr(packed_attention_module, "_cpu_computes_bf16", lambda: True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 24, 16, generator=g).bfloat16() for h in (4, 2, 2))
    layout = causal_rows([range(24)], 24)
    via_matmuls = attend_in_matmuls(q, k, v, None, 16 ** -0.5).transpose(1, 2)
    upcast = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    upcast = upcast.bfloat16().transpose(1, 2)
    assert not torch.equal(via_matmuls, upcast)  # the two routes are told apart by their rounding
    scores = 4 * 24 * 24
    for bound, expected in ((scores, via_matmuls), (scores - 1, upcast)):
        monkeypatch.setattr(packed_attention_module, "MATMUL_ATTENTION_MAX_SCORES", bound)
        out, _ = packed_sdpa_forward(torch.nn.Module(), q, k, v, None, packed_attention=layout)
        assert torch.equal(out, expected), f"bound {bound}"
    monkeypatch.setattr(packed_attention_module, "_cpu_computes_bf16", lambda: False)
    out, _ = packed_sdpa_forward(torch.nn.Module(), q, k, v, None, packed_attention=layout)
    assert torch.equal(out, upcast)


@pytest.mark.parametrize("kind", ["causal rows", "masked blocks", "shared prompts", "chosen"])
def test_a_packed_model_pass_equals_the_dense_mask_pass(tiny_model_dir, kind):
    """Through the tiny model in float64: log-probs, entropies and every parameter's gradient of the packed row
    with block attention equal the same row under the dense mask (the path tests/rl/test_packing.py ties to the
    padded forward)."""
    exp = build_experience(PROMPTS, RESPONSES, [[-1.0] * len(r) for r in RESPONSES], [0, 1, 0, 2, 1, 0], 0)
    mb = trim_padding(exp.tensors())
    valid = mb["action_mask"]
    rollout = pack_rollout(mb["sequences"], mb["attention_mask"], valid.shape[1])
    if kind != "chosen":
        rollout = dataclasses.replace(rollout, blocks=layouts_of(rollout)[kind])
    weights = torch.linspace(-1.0, 2.0, valid.numel(), dtype=torch.float64).view_as(valid) * valid
    results = []
    for blocks in (False, True):
        model = load_causal_lm(tiny_model_dir, attn_implementation="sdpa").double()
        assert not uses_packed_attention(model)
        if blocks:
            assert use_packed_attention(model) and model.config._attn_implementation == PACKED_SDPA
        log_probs, entropy = packed_response_log_probs(model, rollout, 0.8, mask_dtype=torch.float64,
                                                       with_entropy=True, entropy_grad=True)
        ((log_probs + 0.1 * entropy) * weights).sum().backward()
        results.append((log_probs.detach(), entropy.detach(),
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (lp_dense, ent_dense, g_dense), (lp_blocks, ent_blocks, g_blocks) = results
    assert lp_dense.abs().sum() > 1.0 and len(g_dense) > 10
    torch.testing.assert_close(lp_blocks, lp_dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent_blocks, ent_dense, rtol=0, atol=1e-12)
    assert g_blocks.keys() == g_dense.keys()
    for name, expected in g_dense.items():
        torch.testing.assert_close(g_blocks[name], expected, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_calls_without_a_layout_run_plain_sdpa(tiny_model_dir):
    """The padded forward of a model switched to PACKED_SDPA (the weight-sync probe, generation-free paths) is the
    SDPA model's, bit for bit, with left padding."""
    seq = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (seq != 0).long()
    plain = load_causal_lm(tiny_model_dir, attn_implementation="sdpa")
    switched = load_causal_lm(tiny_model_dir, attn_implementation="sdpa")
    assert use_packed_attention(switched)
    with torch.no_grad():
        a = plain(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask)).logits
        b = switched(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_a_model_on_another_attention_kernel_keeps_it_and_gets_the_dense_mask(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, attn_implementation="eager")
    assert not use_packed_attention(model) and model.config._attn_implementation == "eager"
    packed = pack_rows(PROMPTS, RESPONSES, 5)
    inputs = packed.model_inputs(model, torch.float32)
    assert "packed_attention" not in inputs and inputs["attention_mask"].shape == (1, 1, packed.num_tokens,
                                                                                 packed.num_tokens)


def test_the_cost_estimate_picks_rows_for_long_responses_and_shared_prompts_otherwise():
    """GRPO with long answers (8 x 512 after a 60-token prompt): causal rows (their causal blocks skip the kernel's
    upper tiles; the dense mask would compute 7x the scores); a 1,000-token prompt shared by 8 answers of 32, and the
    demo's micro-batch (4 prompts x 8 answers, 30 + 16): shared prompts (rows would repeat the prompt's
    self-attention 8 times, the group's block computes every answer against every other). The rule's constants are
    fitted to measurements (benchmarks/packed_attention.py), where these are the fastest layouts."""
    long_answers = pack_rows([[1] * 60] * 8, [[2] * 512] * 8, 512)
    assert long_answers.blocks.kind == "causal rows"
    assert tuple(long_answers.blocks.parts[0].queries.shape) == (8, 572)
    long_prompt = pack_rows([[1] * 1000] * 8, [[2] * 32] * 8, 32)
    prompts, responses = long_prompt.blocks.parts
    assert long_prompt.blocks.kind == "shared prompts"
    assert tuple(prompts.queries.shape) == (1, 1000) and prompts.mask is None and prompts.keys is None
    assert tuple(responses.queries.shape) == (8, 32) and tuple(responses.keys.shape) == (8, 1032)
    demo = pack_rows([[p] * 30 for p in range(4) for _ in range(8)], [[7] * 16] * 32, 16)
    assert demo.blocks.kind == "shared prompts"


def test_a_layout_that_leaves_a_position_out_is_refused():
    with pytest.raises(ValueError, match=r"positions \[3\] are in no block"):
        causal_rows([[0, 1, 2]], 4)
    with pytest.raises(ValueError, match="in two blocks"):
        masked_blocks([[0, 1], [1, 2]], lambda pos: torch.ones(len(pos), len(pos), dtype=torch.bool), 3)


@pytest.mark.parametrize(("lengths", "kind"), [([3, 2, 4], "masked blocks"), ([300, 260], "causal rows")])
def test_an_offline_packed_row_equals_the_block_causal_mask(tiny_model_dir, lengths, kind):
    """--packing_samples in the offline trainers (`collate_packed`, `model_inputs(batch, model=...)`): short samples
    go as one block under the block-diagonal mask, long ones as causal rows (the cost estimate); logits and every
    gradient equal the dense block-causal mask's (float64)."""
    from rlhfkit.data.collate import collate_packed, model_inputs
    from rlhfkit.models.packed_attention import sample_blocks

    assert sample_blocks(lengths).kind == kind
    g = torch.Generator().manual_seed(1)
    batch = collate_packed([{"input_ids": torch.randint(3, 60, (n,), generator=g).tolist()} for n in lengths])
    weights = torch.randn(1, sum(lengths), 1, dtype=torch.float64, generator=g)
    results = []
    for blocks in (False, True):
        model = load_causal_lm(tiny_model_dir, attn_implementation="sdpa").double()
        if blocks:
            use_packed_attention(model)
        inputs = model_inputs(batch, model=model, explicit_mask=not blocks, dtype=torch.float64)
        assert ("packed_attention" in inputs) == blocks
        logits = model(**inputs).logits
        (logits.log_softmax(-1)[..., :8] * weights).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (dense, g_dense), (got, g_got) = results
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-12)
    assert g_got.keys() == g_dense.keys() and len(g_dense) > 10
    for name, expected in g_dense.items():
        torch.testing.assert_close(g_got[name], expected, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_carries_the_layout_to_the_recomputed_forward(tiny_model_dir, use_reentrant):
    """--gradient_checkpointing recomputes each layer in backward: the layout keyword must reach the recomputation,
    so log-probs and gradients equal the run without checkpointing (float64, exactly: the same operations)."""
    packed = pack_rows([[5, 6, 7]] * 2 + [[9, 10]], [[8, 9, 11], [10], [12, 13]], 3)
    results = []
    for checkpointing in (False, True):
        model = load_causal_lm(tiny_model_dir, attn_implementation="sdpa").double()
        assert use_packed_attention(model)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            model.config.use_cache = False
        log_probs, _ = packed_response_log_probs(model, packed, 1.0, mask_dtype=torch.float64)
        log_probs.sum().backward()
        results.append((log_probs.detach(), [p.grad for p in model.parameters()]))
    (plain, g_plain), (ckpt, g_ckpt) = results
    assert torch.equal(plain, ckpt) and plain.abs().sum() > 1
    assert all(a is not None and torch.equal(a, b) for a, b in zip(g_plain, g_ckpt))
