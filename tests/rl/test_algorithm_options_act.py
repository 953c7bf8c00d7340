"""Each PPO algorithm option acts: a real tiny `rlhfkit ppo` run with the option set away from its default writes its
tensors (`--debug_dump_steps`), and an independent float64 reference written from the formula (docs/algorithms.md),
not by calling rlhfkit.algorithms, reproduces the logged result - and, where it could coincide, differs from what
the default would give. Several options share a run where their assertions do not interfere: one run per
advantage estimator, each one step of 32 rows in two mini-batches (so the second mini-batch's ratios are off 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ppo_helpers import run

from rlhfkit.errors import ConfigError
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.debug_dump import dump_steps

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
ONE_STEP = {"max_samples": 4, "rollout_batch_size": 4, "n_samples_per_prompt": 8, "train_batch_size": 16,
            "micro_train_batch_size": 8, "debug_dump_steps": ["1"]}
RM_MEAN, RM_STD = 0.3, 0.5


# ----------------------------------------------------------------------------------------------- fixtures, helpers
@pytest.fixture(scope="module")
def other_models(tmp_path_factory) -> dict[str, str]:
    """Tiny models with other weights than the policy's: a causal LM (reference), a scalar model with stored reward
    statistics (reward model) and another scalar model (critic)."""
    from rlhfkit.models.tiny import build_tiny_causal_lm, build_tiny_scalar_model

    root = tmp_path_factory.mktemp("other_models")
    ref = build_tiny_causal_lm(str(root / "ref"), seed=11)
    rm = build_tiny_scalar_model(str(root / "rm"), seed=12)
    config = json.loads((Path(rm) / "config.json").read_text())
    (Path(rm) / "config.json").write_text(json.dumps({**config, "reward_mean": RM_MEAN, "reward_std": RM_STD}))
    critic = build_tiny_scalar_model(str(root / "critic"), seed=13)
    return {"ref": ref, "rm": rm, "critic": critic}


def load_dump(out: Path, step: int = 1) -> dict:
    return torch.load(out / "run" / "debug" / f"step_{step}.pt", weights_only=True)


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def micro_batches(dump: dict, role: str = "actor"):
    """(update entry, micro-batch) pairs."""
    for entry in dump[role]:
        for mb in entry["micro_batches"]:
            yield entry, mb


def close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, atol: float = 2e-5, rtol: float = 1e-4) -> None:
    m = mask.bool()
    torch.testing.assert_close(f64(got)[m], f64(want)[m], atol=atol, rtol=rtol)


def differs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, by: float = 1e-4) -> bool:
    return bool(((f64(a) - f64(b)).abs()[mask.bool()] > by).any())


def last_valid(mask: torch.Tensor) -> list[int]:
    return [max(i for i, v in enumerate(row.tolist()) if v) for row in mask]


def shaped_ref(r: list[float], mask: torch.Tensor, kl: torch.Tensor | None, coef: float) -> torch.Tensor:
    """R_t = 1[t = last valid] r - coef kl_t on valid tokens."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b, t in enumerate(last_valid(mask)):
        out[b, t] = r[b]
    if kl is not None:
        out -= coef * f64(kl)
    return out * mask


def discounted_ref(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                running = float(rewards[b, t]) + gamma * running
                out[b, t] = running
    return out


def gae_ref(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
            lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        next_v, last = 0.0, 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
                last = delta + gamma * lambd * last
                adv[b, t] = last
                next_v = float(values[b, t])
    return adv, (adv + f64(values)) * mask


def whiten_ref(x: torch.Tensor, mask: torch.Tensor, std_norm: bool = True) -> torch.Tensor:
    vals = f64(x)[mask.bool()]
    mu = vals.mean()
    var = ((vals - mu) ** 2).mean()
    out = (f64(x) - mu) / (math.sqrt(max(float(var), 1e-8)) if std_norm else 1.0)
    return out * mask


def groups(r: list[float], n: int) -> list[list[float]]:
    return [r[i:i + n] for i in range(0, len(r), n)]


def group_ref(estimator: str, r: list[float], n: int) -> list[float]:
    out = []
    for g in groups(r, n):
        mean = sum(g) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (n - 1))
        for x in g:
            if max(g) == min(g):
                out.append(0.0)
            elif estimator in ("reinforce_baseline", "dr_grpo"):
                out.append(x - mean)
            elif estimator == "group_norm":
                out.append((x - mean) / (std + 1e-6))
            elif estimator == "rloo":
                out.append(x - (sum(g) - x) / (n - 1))
    return out


def kl_ref(log_probs: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    r = (f64(log_probs) - f64(ref)).clamp(-20, 20)
    k = {"k1": r, "k2": r * r / 2, "k3": torch.exp(-r) - 1 + r}[estimator]
    return k.clamp(-10, 10)


def ppo_loss_ref(log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float, high: float,
                 dual: float | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """-min(rho A, clip(rho, 1 - low, 1 + high) A); dual clip: -max(that, c A) where A < 0; times the IS weight."""
    rho = torch.exp((f64(log_probs) - f64(old)).clamp(-20, 20))
    a = f64(adv)
    obj = torch.minimum(rho * a, rho.clamp(1 - low, 1 + high) * a)
    if dual is not None:
        obj = torch.where(a < 0, torch.maximum(obj, dual * a), obj)
    loss = -obj
    return loss if weights is None else loss * f64(weights)


def response_width(dump: dict) -> tuple[int, int]:
    exp = dump["experience"]
    width = exp["action_mask"].shape[1]
    return exp["sequences"].shape[1] - width, width


def hf_log_probs_and_entropy(model_dir: str, sequences: torch.Tensor, attention: torch.Tensor,
                             width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-token log-probs and entropies of a causal LM computed with transformers directly (float64 softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention, position_ids=position_ids(attention)).logits
    logits = f64(logits[:, -width - 1:-1])
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, sequences[:, -width:].unsqueeze(-1)).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


def hf_token_values(model_dir: str, sequences: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The `score` head on every position's final hidden state, computed with transformers directly."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=sequences, attention_mask=attention,
                             position_ids=position_ids(attention)).last_hidden_state
        return f64(model.score(hidden).squeeze(-1))


def check_policy_losses(dump: dict, low: float, high: float, dual: float | None = None,
                        is_weights=None) -> tuple[int, int]:
    """Every micro-batch's logged per-token policy loss (and ratio) against the reference; returns (tokens whose
    clipped term is active, tokens where the dual clip acts)."""
    exp = dump["experience"]
    clipped = dual_active = 0
    for _, mb in micro_batches(dump):
        mask, width = mb["action_mask"], mb["action_mask"].shape[1]
        rows = mb["row_index"]
        close(mb["advantages"], exp["advantages"][rows, :width], mask, atol=1e-6)
        weights = None if is_weights is None else is_weights(mb)
        if weights is not None:
            close(mb["is_weights"], weights, mask, atol=1e-6)
        rho = torch.exp(f64(mb["log_probs"]) - f64(mb["old_log_probs"]))
        close(mb["ratio"], rho, mask)
        close(mb["policy_loss"], ppo_loss_ref(mb["log_probs"], mb["old_log_probs"], mb["advantages"], low, high, dual,
                                              weights), mask)
        a = f64(mb["advantages"])
        unclipped = -(rho * a)
        bounded = -(rho.clamp(1 - low, 1 + high) * a)
        clipped += int(((bounded > unclipped) & mask).sum())
        if dual is not None:
            dual_active += int(((a < 0) & (-dual * a < torch.maximum(unclipped, bounded)) & mask).sum())
    return clipped, dual_active


# ------------------------------------------------------------------------------------------------------ the runs
def test_gae_with_reference_critic_and_reward_model_folders(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                             other_models, tokenizer, tmp_path):
    """gae, --gamma, --lambd, --value_clip, --critic_pretrain, --critic_learning_rate, --ref_pretrain,
    --init_kl_coef with --kl_estimator k2 (reward penalty), --reward_pretrain with --normalize_reward."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **ONE_STEP, advantage_estimator="gae",
        gamma=0.9, lambd=0.8, value_clip=0.02, critic_pretrain=other_models["critic"], critic_learning_rate=2e-3,
        ref_pretrain=other_models["ref"], init_kl_coef=0.05, kl_estimator="k2", remote_rm_url=None,
        reward_pretrain=other_models["rm"], normalize_reward=True)
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    seq, attn, mask = exp["sequences"], exp["attention_mask"], exp["action_mask"]
    prompt_width, width = response_width(dump)

    # --ref_pretrain: the reference log-probs are the other model's, not the policy's.
    ref_lp, _ = hf_log_probs_and_entropy(other_models["ref"], seq, attn, width)
    close(exp["ref_log_probs"], ref_lp, mask, atol=1e-4)
    assert differs(exp["ref_log_probs"], exp["old_log_probs"], mask, by=0.1)
    own_lp, _ = hf_log_probs_and_entropy(tiny_model_dir, seq, attn, width)
    close(exp["old_log_probs"], own_lp, mask, atol=1e-4)

    # --critic_pretrain: the values are the other scalar model's head, at the positions before each response token.
    values = hf_token_values(other_models["critic"], seq, attn)[:, prompt_width - 1:-1]
    close(exp["values"], values, mask, atol=1e-4)

    # --reward_pretrain --normalize_reward: (score at the last token of prompt + response + eos - mean) / std.
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = []
    for i in range(seq.shape[0]):
        prompt = seq[i, :prompt_width][attn[i, :prompt_width].bool()].tolist()
        response = seq[i, prompt_width:][attn[i, prompt_width:].bool()].tolist()
        while response and response[-1] in (eos, pad):
            response.pop()
        rows.append(prompt + response + [eos])
    longest = max(map(len, rows))
    ids = torch.tensor([[pad] * (longest - len(r)) + r for r in rows])
    rm_attn = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
    raw = hf_token_values(other_models["rm"], ids, rm_attn)[:, -1]
    torch.testing.assert_close(f64(exp["rewards"]), (raw - RM_MEAN) / RM_STD, atol=1e-4, rtol=1e-4)

    # --kl_estimator k2 on the logged log-probs.
    close(exp["kl"], kl_ref(exp["old_log_probs"], exp["ref_log_probs"], "k2"), mask, atol=1e-6)

    # --init_kl_coef 0.05 (penalty on every token), --gamma 0.9, --lambd 0.8, GAE whitened over the batch.
    r = f64(exp["rewards"]).clamp(-10, 10).tolist()
    token_rewards = shaped_ref(r, mask, exp["kl"], 0.05)
    adv, returns = gae_ref(token_rewards, exp["values"], mask, 0.9, 0.8)
    close(exp["returns"], returns, mask)
    close(exp["advantages"], whiten_ref(adv, mask), mask, atol=1e-4)
    assert differs(exp["returns"], gae_ref(token_rewards, exp["values"], mask, 1.0, 1.0)[1], mask)
    assert differs(exp["returns"], gae_ref(token_rewards, exp["values"], mask, 0.9, 1.0)[1], mask)
    assert differs(exp["returns"], gae_ref(shaped_ref(r, mask, None, 0.0), exp["values"], mask, 0.9, 0.8)[1], mask)

    # --value_clip 0.02: 0.5 max((V - G)^2, (V_old + clip(V - V_old, +-0.02) - G)^2) per token; the second
    # mini-batch's values moved by more than 0.02 after the first update, so the clipped term acts.
    clipped = 0
    for _, mb in micro_batches(dump, "critic"):
        m, rows_ = mb["action_mask"], mb["row_index"]
        close(mb["old_values"], exp["values"][rows_, :m.shape[1]], m, atol=1e-6)
        close(mb["returns"], exp["returns"][rows_, :m.shape[1]], m, atol=1e-6)
        v, v_old, g = f64(mb["values"]), f64(mb["old_values"]), f64(mb["returns"])
        plain = (v - g) ** 2
        bounded = (v_old + (v - v_old).clamp(-0.02, 0.02) - g) ** 2
        close(mb["value_loss"], 0.5 * torch.maximum(plain, bounded), m, atol=1e-6)
        clipped += int(((bounded > plain) & m).sum())
    assert clipped > 0

    # --critic_learning_rate 2e-3: Adam's first step moves each parameter by lr g / (|g| + eps), at most lr.
    first = dump["critic"][0]
    assert first["lr"] == pytest.approx(2e-3)
    assert first["update_max_abs"] == pytest.approx(2e-3, rel=1e-3)


def test_group_norm_with_clipping_entropy_and_update_size(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                          tmp_path):
    """group_norm, --eps_clip, --dual_clip, --entropy_loss_coef, --max_norm, --actor_learning_rate,
    --enable_vllm_is_correction tis with --vllm_is_truncated_threshold (a floor above 1, so every weight is raised)."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **{**ONE_STEP, "debug_dump_steps": ["all"]},
        advantage_estimator="group_norm", eps_clip=0.05, dual_clip=1.2, entropy_loss_coef=0.05, max_norm=0.05,
        actor_learning_rate=2e-2, enable_vllm_is_correction=True, vllm_is_correction_type="tis",
        vllm_is_truncated_threshold=[1.5, 5.0])
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    mask, n = exp["action_mask"], 8

    # group_norm: (r - mean_g) / (std_g + 1e-6) on every token of the response, not whitened.
    adv = group_ref("group_norm", f64(exp["rewards"]).tolist(), n)
    close(exp["advantages"], torch.tensor(adv).unsqueeze(1).expand(mask.shape), mask, atol=1e-5)
    assert any(max(g) > min(g) for g in groups(exp["rewards"].tolist(), n))

    # --eps_clip 0.05, --dual_clip 1.2, tis weights clamp(exp(old - rollout), 1.5, 5.0).
    def tis(mb):
        return torch.exp(f64(mb["old_log_probs"]) - f64(mb["rollout_log_probs"])).clamp(1.5, 5.0)

    clipped, dual = check_policy_losses(dump, 0.05, 0.05, 1.2, tis)
    assert clipped > 0 and dual > 0, (clipped, dual)
    assert any(differs(mb["policy_loss"], ppo_loss_ref(mb["log_probs"], mb["old_log_probs"], mb["advantages"], 0.2,
                                                       0.2, 1.2, tis(mb)), mb["action_mask"], by=1e-6)
               for _, mb in micro_batches(dump))  # --eps_clip 0.05 is not the default 0.2
    assert all(bool((mb["is_weights"][mb["action_mask"]] >= 1.5).all()) for _, mb in micro_batches(dump))

    # --entropy_loss_coef 0.05: the loss backward got = policy term - 0.05 x token-mean entropy. On the first
    # update the policy is still --pretrain: its entropies, computed with transformers, are the logged ones.
    for entry, mb in micro_batches(dump):
        m, tokens = mb["action_mask"], entry["num_tokens"]
        want = (f64(mb["policy_loss"]) * m).sum() / tokens - 0.05 * (f64(mb["entropy"]) * m).sum() / tokens
        assert float(mb["loss"]) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    first = dump["actor"][0]
    for mb in first["micro_batches"]:
        rows, width = mb["row_index"], mb["action_mask"].shape[1]
        own_lp, entropy = hf_log_probs_and_entropy(tiny_model_dir, exp["sequences"][rows],
                                                   exp["attention_mask"][rows], exp["action_mask"].shape[1])
        close(mb["entropy"], entropy[:, :width], mb["action_mask"], atol=1e-4)
        close(mb["log_probs"], own_lp[:, :width], mb["action_mask"], atol=1e-4)

    # --max_norm 0.05: the gradient is rescaled to norm min(||g||, 0.05).
    for entry in dump["actor"]:
        assert entry["grad_norm"] > 0.05
        assert entry["grad_norm_after_clip"] == pytest.approx(0.05, rel=1e-4)

    # --actor_learning_rate 2e-2: Adam's first step moves each parameter by lr g / (|g| + eps), at most lr.
    assert first["lr"] == pytest.approx(2e-2)
    assert first["update_max_abs"] == pytest.approx(2e-2, rel=1e-3)


def test_reinforce_with_discount_reward_clip_and_asymmetric_clip(tiny_model_dir, echo_prompt_file,
                                                                 rollout_vllm_engine, tmp_path):
    """reinforce, --gamma (discounted returns), --reward_clip_range, --eps_clip_low_high."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **ONE_STEP, advantage_estimator="reinforce",
        gamma=0.7, reward_clip_range=[0.05, 0.25], eps_clip_low_high=[0.02, 0.4])
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    mask = exp["action_mask"]
    r = f64(exp["rewards"])
    assert bool(((r < 0.05) | (r > 0.25)).any()), r  # --reward_clip_range acts on this batch
    returns = discounted_ref(shaped_ref(r.clamp(0.05, 0.25).tolist(), mask, None, 0.0), mask, 0.7)
    close(exp["returns"], returns, mask, atol=1e-6)
    close(exp["advantages"], whiten_ref(returns, mask), mask, atol=1e-4)
    assert differs(exp["returns"], discounted_ref(shaped_ref(r.tolist(), mask, None, 0.0), mask, 0.7), mask)
    assert differs(exp["returns"], discounted_ref(shaped_ref(r.clamp(0.05, 0.25).tolist(), mask, None, 0.0), mask,
                                                  1.0), mask)
    # --eps_clip_low_high 0.02 0.4: clip(rho, 0.98, 1.4); differs from the symmetric default 0.2 on this batch.
    clipped, _ = check_policy_losses(dump, 0.02, 0.4)
    assert clipped > 0
    assert any(differs(mb["policy_loss"], ppo_loss_ref(mb["log_probs"], mb["old_log_probs"], mb["advantages"], 0.2,
                                                       0.2), mb["action_mask"], by=1e-6)
               for _, mb in micro_batches(dump))


def test_reinforce_baseline_without_std_normalisation(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                      tmp_path):
    """reinforce_baseline, --no_advantage_std_norm (whitening only subtracts the batch mean)."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **ONE_STEP,
        advantage_estimator="reinforce_baseline", no_advantage_std_norm=True)
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    mask = exp["action_mask"]
    baseline = group_ref("reinforce_baseline", f64(exp["rewards"]).tolist(), 8)
    returns = discounted_ref(shaped_ref(baseline, mask, None, 0.0), mask, 1.0)
    close(exp["returns"], returns, mask, atol=1e-6)
    close(exp["advantages"], whiten_ref(returns, mask, std_norm=False), mask, atol=1e-6)
    assert differs(exp["advantages"], whiten_ref(returns, mask, std_norm=True), mask)
    check_policy_losses(dump, 0.2, 0.2)


def test_rloo_with_the_kl_loss(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, other_models, tmp_path):
    """rloo, --use_kl_loss with --init_kl_coef and --kl_estimator k3 against a --ref_pretrain of other weights."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, **ONE_STEP, advantage_estimator="rloo",
        use_kl_loss=True, init_kl_coef=0.1, kl_estimator="k3", ref_pretrain=other_models["ref"])
    dump = load_dump(tmp_path)
    exp = dump["experience"]
    mask = exp["action_mask"]
    # rloo: r_i - mean of the other n - 1; with --use_kl_loss no KL in the rewards.
    adv = torch.tensor(group_ref("rloo", f64(exp["rewards"]).tolist(), 8)).unsqueeze(1).expand(mask.shape)
    close(exp["advantages"], adv, mask, atol=1e-6)
    check_policy_losses(dump, 0.2, 0.2)
    for entry, mb in micro_batches(dump):
        m, tokens, width = mb["action_mask"], entry["num_tokens"], mb["action_mask"].shape[1]
        close(mb["ref_log_probs"], exp["ref_log_probs"][mb["row_index"], :width], m, atol=1e-6)
        kl = kl_ref(mb["log_probs"], mb["ref_log_probs"], "k3")
        close(mb["kl"], kl, m, atol=1e-5)
        assert differs(mb["kl"], kl_ref(mb["log_probs"], mb["ref_log_probs"], "k1"), m, by=1e-3)
        want = (f64(mb["policy_loss"]) * m).sum() / tokens + 0.1 * (kl * m).sum() / tokens
        assert float(mb["loss"]) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
        assert 0.1 * float((kl * m).sum()) / tokens > 1e-4  # the reference differs: the KL term is not zero


def test_dr_grpo_async_with_icepop_dumps_only_the_steps_asked_for(tiny_model_dir, echo_prompt_file,
                                                                  rollout_vllm_engine, tmp_path):
    """dr_grpo; --vllm_is_correction_type icepop with --vllm_is_truncated_threshold on step 2 of an --async_train
    run, sampled one update behind the trainer; --debug_dump_steps 2 writes that step only."""
    run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine,
        **{**ONE_STEP, "max_samples": 8, "debug_dump_steps": ["2"]}, advantage_estimator="dr_grpo",
        async_train=True, enable_vllm_is_correction=True, vllm_is_correction_type="icepop",
        vllm_is_truncated_threshold=[0.8, 1.25])
    assert sorted(p.name for p in (tmp_path / "run" / "debug").iterdir()) == ["step_2.pt"]
    dump = load_dump(tmp_path, 2)
    assert dump["step"] == 2 and dump["config"]["debug_dump_steps"] == ["2"]
    exp = dump["experience"]
    mask = exp["action_mask"]
    adv = torch.tensor(group_ref("dr_grpo", f64(exp["rewards"]).tolist(), 8)).unsqueeze(1).expand(mask.shape)
    close(exp["advantages"], adv, mask, atol=1e-6)

    def icepop(mb):
        w = torch.exp(f64(mb["old_log_probs"]) - f64(mb["rollout_log_probs"]))
        return torch.where((w >= 0.8) & (w <= 1.25), w, torch.zeros_like(w))

    check_policy_losses(dump, 0.2, 0.2, None, icepop)
    kept = dropped = 0
    for _, mb in micro_batches(dump):
        m = mb["action_mask"]
        kept += int(((mb["is_weights"] > 0) & m).sum())
        dropped += int(((mb["is_weights"] == 0) & m).sum())
    assert kept > 0 and dropped > 0, (kept, dropped)


def test_debug_dump_steps_values():
    assert dump_steps(None) is None and dump_steps([]) is None
    assert dump_steps(["all"]) == "all"
    assert dump_steps(["1", "3"]) == {1, 3}
    for bad in (["x"], ["0"], ["all", "2"]):
        with pytest.raises(ConfigError, match="--debug_dump_steps"):
            dump_steps(bad)
