"""`--param_dtype auto` / `--vllm_dtype auto`: bf16 where the hardware computes it natively, fp32 elsewhere."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.config.commands import PPOConfig, SFTConfig
from rlhfkit.engine import precision
from rlhfkit.engine.fsdp import compute_dtype

AVX2 = ("AVX2", False)
ZEN4 = ("AVX512+AVX512-BF16", True)


@pytest.fixture
def unpinned(monkeypatch, tmp_path):
    """auto as a user sees it: no RLHFKIT_AUTO_DTYPE pin, a private probe cache, nothing memoised."""
    monkeypatch.delenv("RLHFKIT_AUTO_DTYPE", raising=False)
    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "_RESOLVED", {})
    return tmp_path / "cache"


def fake_machine(monkeypatch, capability: tuple[str, bool], fp32: float, bf16: float) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_capability", lambda: capability)
    rates = {torch.float32: fp32, torch.bfloat16: bf16}
    monkeypatch.setattr(precision, "measure_matmul_gflops", lambda dtype, *a, **k: rates[dtype])


def test_auto_is_fp32_on_an_avx2_cpu(unpinned, monkeypatch):
    fake_machine(monkeypatch, AVX2, fp32=170.0, bf16=1.3)
    choice = precision.resolve_precision("auto", "cpu")
    assert (choice.dtype, choice.native_bf16) == ("fp32", False)
    assert "no native bf16" in choice.reason and "bf16 1.3 vs fp32 170" in choice.reason
    assert choice.ceiling_gflops() == 170.0


def test_auto_is_bf16_on_a_cpu_with_avx512_bf16(unpinned, monkeypatch):
    fake_machine(monkeypatch, ZEN4, fp32=177.0, bf16=404.0)
    choice = precision.resolve_precision("auto", "cpu")
    assert (choice.dtype, choice.native_bf16) == ("bf16", True)
    assert choice.reason.startswith("auto: native bf16") and choice.ceiling_gflops() == 404.0
    assert compute_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_the_probe_overrules_a_flag_that_does_not_pay(unpinned, monkeypatch):
    fake_machine(monkeypatch, ZEN4, fp32=177.0, bf16=90.0)  # flags say bf16, the matmul says otherwise
    choice = precision.resolve_precision("auto", "cpu")
    assert choice.dtype == "fp32" and "slower than fp32" in choice.reason


def test_an_explicit_dtype_is_kept(unpinned, monkeypatch):
    fake_machine(monkeypatch, AVX2, fp32=170.0, bf16=1.3)
    assert precision.resolve_precision("bf16", "cpu").dtype == "bf16"
    assert precision.resolve_precision("fp32", "cpu").reason.startswith("requested")
    with pytest.raises(ValueError, match="--param_dtype 'int8'"):
        precision.resolve_precision("int8", "cpu")
    # a command's --param_dtype bf16 is what its run computes in, though auto would pick fp32 on this machine
    sft = SFTConfig(param_dtype="bf16")
    assert precision.apply_precision(sft, "cpu").dtype == "bf16" and sft.param_dtype == "bf16"  # as given
    assert precision.apply_precision(SFTConfig(), "cpu").dtype == "fp32"


def test_apply_resolves_both_flags_and_warns_once_with_the_measured_slowdown(unpinned, monkeypatch, caplog):
    fake_machine(monkeypatch, AVX2, fp32=170.0, bf16=1.7)
    cfg = PPOConfig(param_dtype="auto", vllm_dtype="auto")  # --vllm_dtype is ppo's
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        choice = precision.apply_precision(cfg, "cpu")
    assert (choice.dtype, precision.engine_dtype_of(cfg, choice)) == ("fp32", "fp32")
    assert (cfg.param_dtype, cfg.vllm_dtype, cfg.precision) == ("auto", "auto", None)  # the config is not written
    assert not caplog.records  # auto never warns
    cfg = PPOConfig(param_dtype="fp32", vllm_dtype="bf16")
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        precision.apply_precision(cfg, "cpu")
    (record,) = caplog.records
    assert "--vllm_dtype bf16" in record.getMessage() and "100x slower" in record.getMessage()  # 170 / 1.7
    sft = SFTConfig(param_dtype="auto")  # a command without engines: only --param_dtype
    assert precision.apply_precision(sft, "cpu") == choice and precision.engine_dtype_of(sft, choice) is None
    assert sft.param_dtype == "auto" and sft.precision is None


def test_the_real_probe_measures_both_dtypes_on_this_cpu():
    fp32 = precision.measure_matmul_gflops(torch.float32)
    bf16 = precision.measure_matmul_gflops(torch.bfloat16)
    assert fp32 > 0.5 and bf16 > 0.0  # how fast depends on the CPU and on what else runs: not asserted here


def test_the_probe_is_measured_once_per_machine_and_cached(unpinned, monkeypatch):
    rates = iter([170.0, 1.3])  # an idle AVX2 machine; the real probe's rate depends on the load (CI's varies)
    monkeypatch.setattr(precision, "measure_matmul_gflops", lambda dtype, *a, **k: next(rates))
    first = precision.cpu_matmul_rates()
    assert (first["fp32_gflops"], first["bf16_gflops"]) == (170.0, 1.3)
    assert first["key"]["cpu"] == precision.cpu_model_name()
    cached = list(unpinned.glob("precision/*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == first

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again despite the cache")

    monkeypatch.setattr(precision, "measure_matmul_gflops", no_probe)
    assert precision.cpu_matmul_rates() == first
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count is another machine setting
    with pytest.raises(AssertionError, match="probed again"):
        precision.cpu_matmul_rates()


def test_this_machine_gets_what_its_hardware_says(unpinned):
    capability, flagged = precision.cpu_bf16_capability()
    choice = precision.resolve_precision("auto", "cpu")
    assert choice.capability == capability
    assert choice.native_bf16 == (flagged and choice.bf16_gflops >= choice.fp32_gflops)
    assert choice.dtype == ("bf16" if choice.native_bf16 else "fp32")
    assert compute_dtype("auto", torch.device("cpu")) == precision.TORCH_DTYPES[choice.dtype]


def test_the_suite_pin_and_its_record(monkeypatch):
    monkeypatch.setattr(precision, "_RESOLVED", {})
    monkeypatch.setenv("RLHFKIT_AUTO_DTYPE", "bf16")
    assert precision.resolve_precision("auto", "cpu").reason == "auto pinned to bf16 by RLHFKIT_AUTO_DTYPE"
    assert precision.resolve_precision("fp32", "cpu").dtype == "fp32"  # explicit flags are not pinned
    monkeypatch.setenv("RLHFKIT_AUTO_DTYPE", "fp8")
    with pytest.raises(ValueError, match="RLHFKIT_AUTO_DTYPE='fp8'"):
        precision.resolve_precision("auto", "cpu")


def test_manifest_table_and_report_show_the_choice(tiny_model_dir, unpinned, monkeypatch, tmp_path):
    from rlhfkit.cli.sft import main as sft_main
    from rlhfkit.config.parse import flags_to_argv
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    fake_machine(monkeypatch, AVX2, fp32=150.0, bf16=1.5)
    data = write_jsonl(echo_rows(8, seed=1), tmp_path / "train.jsonl")
    run = tmp_path / "run"
    sft_main(flags_to_argv({"pretrain": tiny_model_dir, "dataset": data, "input_key": "input",
                            "output_key": "output", "max_len": 64, "train_batch_size": 4,
                            "micro_train_batch_size": 4, "max_epochs": 1, "run_dir": str(run)}))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["config"]["param_dtype"] == "fp32"
    assert manifest["precision"]["dtype"] == "fp32" and manifest["precision"]["bf16_gflops"] == 1.5
    assert manifest["precision"]["device_name"] == precision.cpu_model_name()
    report = Path(run / "report.html").read_text()
    assert "auto: no native bf16 on this CPU (AVX2 CPU, matmul bf16 1.5 vs fp32 150 GFLOP/s)" in report
    assert "measured matmul fp32 150.0 GFLOP/s, bf16 1.5 GFLOP/s" in report


def test_a_fresh_process_probe_is_not_fooled_by_the_first_call():
    """The first matmul of a process starts the thread pool: timed, it read fp32 as 2 GFLOP/s on a 170 GFLOP/s CPU
    (and would read bf16 as slow on a CPU that has it). The probe leaves it out of the timing."""
    import subprocess
    import sys

    code = ("import torch; from rlhfkit.engine.precision import measure_matmul_gflops; "
            "print(measure_matmul_gflops(torch.float32))")
    fresh = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 timeout=120).stdout.split()[-1])
    warm = max(precision.measure_matmul_gflops(torch.float32) for _ in range(2))
    assert fresh > warm / 5, (fresh, warm)  # a factor of 5 for load noise; the bug was a factor of ~90


def test_starting_ray_probes_the_cpu_first(monkeypatch):
    """At a run's start Ray's worker processes load both cores for seconds; a probe then read fp32 as 2 GFLOP/s.
    `start_ray` (ppo and batch-inference) probes, cached, before it starts Ray."""
    import ray

    from rlhfkit.launch import ray_cluster

    calls = []

    def fake_init(*args, **kwargs):
        calls.append("ray")
        raise RuntimeError("stop at Ray")

    monkeypatch.setattr(ray_cluster, "cpu_matmul_rates", lambda: calls.append("probe"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RuntimeError, match="stop at Ray"):
        ray_cluster.start_ray(SimpleNamespace(ray_address=None, verbose=True))
    assert calls == ["probe", "ray"]

def test_a_probe_on_a_busy_machine_is_not_cached_and_the_flags_decide(unpinned, monkeypatch):
    fake_machine(monkeypatch, ZEN4, fp32=2.0, bf16=1.1)  # what two busy processes did to a 2-core probe
    choice = precision.resolve_precision("auto", "cpu")
    assert choice.dtype == "bf16" and "busy during the probe" in choice.reason
    assert not list(unpinned.glob("precision/*.json"))  # the next run probes again
    monkeypatch.setattr(precision, "_RESOLVED", {})
    fake_machine(monkeypatch, AVX2, fp32=2.0, bf16=1.1)
    assert precision.resolve_precision("auto", "cpu").dtype == "fp32"


def test_cpu_share_is_cpu_time_over_the_threads_wall_time():
    assert precision.cpu_share(1.0, 1.0, 2) == pytest.approx(0.5)   # two threads that ran half the time
    assert precision.cpu_share(0.2, 0.1, 2) == pytest.approx(1.0)   # both threads the whole time
    assert precision.cpu_share(0.0, 1e-4, 2) == 1.0                 # too short to tell


def test_a_probe_beside_busy_processes_is_not_cached_and_sets_no_ceiling(unpinned):
    """Real contention: one busy process per core while the probe runs. Its best single matmul can still read near
    the quiet rate (or far below it), so the rate alone cannot tell; the threads' share of the cores can
    (measured on a 2-core AMD EPYC: 0.33-0.51 beside busy processes, 0.96-1.0 alone; the bound is 0.75)."""
    import subprocess
    import sys

    from rlhfkit.engine.cpu_threads import node_cores

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(node_cores())]
    try:
        rates = precision.cpu_matmul_rates()
        choice = precision.resolve_precision("auto", "cpu")
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert rates["contended"] and rates["cpu_share"] < 0.75
    assert not list(unpinned.glob("precision/*.json"))          # the next run probes again
    assert "busy during the probe" in choice.reason and choice.ceiling_gflops() is None  # so no MFU is reported
    # alone, in the same process: probed again and kept (three tries: a test machine has background work of its own)
    quiet = next((choice for choice in (precision.resolve_precision("auto", "cpu") for _ in range(3))
                  if choice.ceiling_gflops()), None)
    assert quiet is not None and list(unpinned.glob("precision/*.json"))


def test_forget_cpu_rates_deletes_the_cached_probe(unpinned, monkeypatch):
    fake_machine(monkeypatch, AVX2, fp32=170.0, bf16=1.3)
    precision.cpu_matmul_rates()
    (cached,) = unpinned.glob("precision/*.json")
    assert precision.forget_cpu_rates() == cached and not cached.exists()
    assert precision.forget_cpu_rates() is None


def test_the_ray_driver_never_creates_a_cuda_context(unpinned, monkeypatch):
    """A CUDA context in the driver takes GPU memory that colocated engines and trainers count on."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("the driver touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("is_bf16_supported", "get_device_capability", "get_device_name", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(precision, "measure_matmul_gflops", no_cuda)
    cfg = PPOConfig(param_dtype="auto", vllm_dtype="auto")  # --vllm_dtype is ppo's
    choice = precision.apply_precision(cfg, "cuda", touch_device=False)
    assert (choice.dtype, precision.engine_dtype_of(cfg, choice), choice.reason) == ("bf16", "bf16",
                                                                                     "auto: bf16 on GPUs")
    with pytest.raises(AssertionError, match="touched CUDA"):  # a training rank does look at its own GPU
        precision.resolve_precision("auto", "cuda")
