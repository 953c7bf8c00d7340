"""The per-sample trace (samples.jsonl, every training sample of every step) and the report's samples page: one
short `rlhfkit ppo` run (2 steps of 4 prompts x 8 samples, step 2 also dumped by --debug_dump_steps) shared by the
assertions, checked against the run's metrics and the dump's tensors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from ppo_helpers import run

from rlhfkit.cli.report import main as report_main
from rlhfkit.errors import ReportError
from rlhfkit.observability.report import write_report
from rlhfkit.observability.trace import policy_version, trace_rows
from rlhfkit.rl.experience import build_experience
from rlhfkit.rl.make_experience import Rollout
from rlhfkit.rollout.types import RolloutSample

ROWS_PER_STEP = 4 * 8


@pytest.fixture(scope="module")
def traced(tiny_model_dir, echo_prompt_file, vllm_engine_session, tiny_model_weights, tmp_path_factory):
    from rlhfkit.rollout.weight_sync import sync_weights

    sync_weights([vllm_engine_session], tiny_model_weights)  # as the rollout_vllm_engine fixture does
    out = tmp_path_factory.mktemp("trace")
    metrics = run(tiny_model_dir, echo_prompt_file, out, vllm_engine_session, max_samples=8, debug_dump_steps=["2"])
    lines = (out / "run" / "samples.jsonl").read_text().splitlines()
    return out / "run", metrics, [json.loads(line) for line in lines]


def _by_step(samples):
    steps: dict[int, list[dict]] = {}
    for row in samples:
        steps.setdefault(row["step"], []).append(row)
    return steps


def test_one_line_per_sample_per_step_with_the_steps_rewards(traced, tokenizer):
    run_dir, metrics, samples = traced
    steps = _by_step(samples)
    assert sorted(steps) == [1, 2] == [m["step"] for m in metrics]
    for m in metrics:
        rows = steps[m["step"]]
        assert len(rows) == ROWS_PER_STEP and {r["kind"] for r in rows} == {"train"}
        assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == \
            [(p, j) for p in range(4) for j in range(8)]
        assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(m["rollout/reward_mean"], abs=1e-6)
        assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(m["rollout/score_mean"], abs=1e-6)
        assert sum(r["response_length"] for r in rows) / len(rows) == \
            pytest.approx(m["rollout/response_length_mean"])
        # one global mini-batch per step: each sample's share of the loss is its tokens / the batch's tokens
        total = sum(r["trained_tokens"] for r in rows)
        for r in rows:
            assert r["loss_weight"] == pytest.approx(r["trained_tokens"] / total, rel=1e-6)
            assert r["policy_version"] == m["step"] - 1 and r["policy_versions"] == [m["step"] - 1]
            assert r["finish_reason"] in ("stop", "length")
            assert (r["finish_reason"] == "length") == (r["response_length"] == 8)
            assert r["turns"] is None and r["trained_tokens"] == r["response_length"]
        assert sum(r["loss_weight"] for r in rows) == pytest.approx(1.0)
        # the trainer's log-probs came from the training forward (one optimizer step): per-sample mismatch, whose
        # token-weighted mean is the step's metric
        mean = sum(r["logprob_abs_diff_mean"] * r["trained_tokens"] for r in rows) / total
        assert mean == pytest.approx(m["rollout/logprob_abs_diff_mean"], rel=1e-4, abs=1e-7)
        assert max(r["logprob_abs_diff_max"] for r in rows) == \
            pytest.approx(m["rollout/logprob_abs_diff_max"], rel=1e-4, abs=1e-7)
    for r in samples:
        assert tokenizer.decode(r["response_ids"], skip_special_tokens=True) == r["response"]
        assert len(r["tokens"]) == len(r["token_advantages"]) == len(r["token_logprob_abs_diff"]) == \
            len(r["response_ids"]) == r["response_length"]


def test_advantages_and_mismatch_are_the_dumped_steps(traced):
    run_dir, _, samples = traced
    rows = _by_step(samples)[2]
    dump = torch.load(run_dir / "debug" / "step_2.pt", weights_only=False)
    exp = dump["experience"]
    mask, adv = exp["action_mask"], exp["advantages"].double()
    assert exp["rewards"].tolist() == pytest.approx([r["reward"] for r in rows])
    assert len({round(r["advantage"], 4) for r in rows}) > 2  # not all equal: the comparison bites
    for i, r in enumerate(rows):
        m = mask[i]
        assert r["advantage"] == pytest.approx(float(adv[i][m].mean()), abs=1e-5)
        assert r["advantage_first"] == pytest.approx(float(adv[i][m][0]), abs=1e-5)
        assert r["token_advantages"] == pytest.approx(adv[i][:r["response_length"]].tolist(), abs=1e-5)
    seen = 0
    for entry in dump["actor"]:
        for mb in entry["micro_batches"]:
            d = (mb["old_log_probs"].double() - mb["rollout_log_probs"].double()).abs()
            for j, row in enumerate(mb["row_index"].tolist()):
                m = mb["action_mask"][j]
                assert rows[row]["logprob_abs_diff_mean"] == pytest.approx(float(d[j][m].mean()), rel=1e-4, abs=1e-8)
                assert rows[row]["logprob_abs_diff_max"] == pytest.approx(float(d[j][m].max()), rel=1e-4, abs=1e-8)
                seen += 1
    assert seen == ROWS_PER_STEP


def _table_rows(html: str) -> int:
    return len(re.findall(r'<tr class="sample[^"]*" data-row=', html))


def test_the_report_writes_the_samples_page_of_a_step(traced, capsys):
    run_dir, _, _ = traced
    report = write_report(run_dir)
    page = (run_dir / "samples.html").read_text()
    assert 'href="samples.html"' in report.read_text()
    assert 'data-step="2"' in page and _table_rows(page) == ROWS_PER_STEP
    assert page.count("onclick=\"sortBy(this)\"") >= 15 and "function sortBy" in page
    assert not re.search(r'<(script|link|img)[^>]*(src|href)=', page)  # nothing to fetch: renders offline
    first = page[page.index('id="tokens-0"'):page.index('id="tokens-1"')]
    tokens = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[ROWS_PER_STEP])["tokens"]
    assert first.count("<span style=") == 2 * len(tokens)  # coloured by advantage, and by mismatch
    report_main([str(run_dir), "--step", "1"])
    page = (run_dir / "samples.html").read_text()
    assert 'data-step="1"' in page and _table_rows(page) == ROWS_PER_STEP
    assert capsys.readouterr().out.split() == [str(report), str(run_dir / "samples.html")]
    with pytest.raises(ReportError, match="--step 3: samples.jsonl has no samples of that step .*: 1-2"):
        write_report(run_dir, step=3)


def test_trace_rows_with_a_separate_old_log_prob_pass(tokenizer):
    """The other source of the mismatch (old log-probs from their own pass), an agent's environment tokens (not
    trained: no advantage, no mismatch) and per-sample reward components; --async_train's policy version."""
    ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("hello", "world", "again")]
    samples = [RolloutSample(0, 0, [1, 2], ids, [-1.0, 0.0, -2.0], "stop", {"turns": 2}, [True, False, True]),
               RolloutSample(0, 1, [1, 2], ids[:1], [-0.5], "length", {"turns": 1})]
    exp = build_experience([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                           [s.response_logprobs for s in samples], [0, 0], 0, [s.action_mask for s in samples])
    exp.old_log_probs = torch.tensor([[-1.5, 5.0, -1.0], [-0.25, 0.0, 0.0]])
    exp.advantages = torch.tensor([[1.0, 9.0, 3.0], [-1.0, 0.0, 0.0]])
    exp.rewards, exp.scores = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])
    rollout = Rollout([{"prompt": "p", "label": "l"}], samples, exp.rewards, exp.scores, ["a", "b"],
                      extra_logs={"format": torch.tensor([0.5, 0.25]), "one_value": torch.tensor([1.0])})
    first, second = trace_rows(5, rollout, exp, tokenizer, async_train=True)
    assert first["advantage"] == 2.0 and first["advantage_first"] == 1.0
    assert first["token_advantages"] == [1.0, None, 3.0] and first["token_logprob_abs_diff"] == [0.5, None, 1.0]
    assert first["logprob_abs_diff_mean"] == 0.75 and first["logprob_abs_diff_max"] == 1.0
    assert first["trained_tokens"] == 2 and first["response_length"] == 3 and first["turns"] == 2
    assert first["reward_components"] == {"format": 0.5} and second["reward_components"] == {"format": 0.25}
    assert second["logprob_abs_diff_mean"] == 0.25 and second["finish_reason"] == "length"
    assert first["loss_weight"] is None  # not trained (no train_on_experience here)
    assert first["policy_version"] == 3 == policy_version(5, True) and policy_version(1, True) == 0
