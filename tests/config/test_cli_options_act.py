"""The flags of `rlhfkit serve-rm`, `rlhfkit lora-merge` and `rlhfkit demo` act (checked on what each builds,
without serving, training or starting Ray)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch

import rlhfkit.rewards.server as server_module


def test_serve_rm_flags_reach_the_reward_source_and_the_server(monkeypatch):
    seen = {}

    class Source:
        name = "fake"

    monkeypatch.setattr(server_module, "build_reward_source", lambda specs, **kw: seen.update(specs=specs, kw=kw)
                        or Source())
    server = server_module.build_server([
        "--reward_pretrain", "rm-a,rm-b", "--remote_rm_url", "builtin:format", "--host", "127.0.0.1", "--port", "0",
        "--auth_token", "secret", "--normalize_reward", "--max_len", "99", "--batch_size", "3", "--param_dtype",
        "bf16", "--attn_implementation", "eager", "--reward_timeout", "7", "--reward_error_policy", "zero",
        "--reward_combine", "sum", "--reward_weights", "0.5,1.5,2", "--reward_format_pattern", "^<a>.*</a>$"])
    try:
        # --port 0: a free port the system picks, not the default 5000 (test below: --host and a given --port)
        assert server.server_address[0] == "127.0.0.1" and server.server_address[1] not in (0, 5000)
        assert server.token == "secret"  # --auth_token: requests need 'Authorization: Bearer secret'
        assert seen["specs"] == ["rm-a,rm-b", "builtin:format"]
        kw = seen["kw"]
        assert (kw["timeout"], kw["error_policy"], kw["combine_rule"], kw["weights"], kw["format_pattern"]) == \
            (7.0, "zero", "sum", [0.5, 1.5, 2.0], "^<a>.*</a>$")
        assert kw["model_kwargs"] == {"normalize_reward": True, "max_len": 99, "micro_batch_size": 3,
                                      "dtype": torch.bfloat16, "attn_implementation": "eager",
                                      "use_fast_tokenizer": True}
    finally:
        server.server_close()
    from rlhfkit.config.commands import ServeRMConfig
    from rlhfkit.rewards.reward_func import DEFAULT_TIMEOUT

    assert ServeRMConfig().reward_timeout == DEFAULT_TIMEOUT  # the config layer cannot import rewards: one value
    # --value_head_prefix: only the 'score' head exists; anything else is refused
    with pytest.raises(SystemExit):
        server_module.build_server(["--remote_rm_url", "builtin:exact", "--port", "0", "--value_head_prefix", "v"])


def free_port_on(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def test_serve_rm_listens_on_the_host_and_port_it_is_given():
    """--host 127.0.0.2 --port P (neither the default 127.0.0.1 nor 5000): the real server answers GET /health over
    HTTP at 127.0.0.2:P, and nothing listens on 127.0.0.1:P (it bound the address it was given, not all of them)."""
    host = "127.0.0.2"  # a loopback address other than the default's (Linux routes all of 127/8 to lo)
    port = free_port_on(host)
    server = server_module.build_server(["--remote_rm_url", "builtin:format", "--host", host, "--port", str(port)])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        assert server.url == f"http://{host}:{port}/get_reward"
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5) as response:
            health = json.loads(response.read())
            assert (health["status"], health["source"]) == ("ok", server.source.name)
        with pytest.raises(urllib.error.URLError):  # connection refused: not bound to the default host
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_lora_merge_writes_the_merged_model_in_param_dtype(tiny_model_dir, tmp_path):
    from rlhfkit.cli.lora_merge import main as lora_merge
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(tiny_model_dir), 4, 8, ["q_proj"], 0.0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    outputs = {}
    for dtype in ("fp32", "bf16"):
        out = lora_merge(["--pretrain", tiny_model_dir, "--lora_path", str(adapter), "--output_path",
                          str(tmp_path / dtype), "--param_dtype", dtype])
        outputs[dtype] = out
    from safetensors.torch import load_file

    merged = {d: load_file(next((tmp_path / d).glob("*.safetensors"))) for d in outputs}
    key = next(k for k in merged["fp32"] if "q_proj.weight" in k)
    assert merged["fp32"][key].dtype == torch.float32 and merged["bf16"][key].dtype == torch.bfloat16
    base = load_causal_lm(tiny_model_dir).state_dict()
    base_key = next(k for k in base if k.endswith(key.split("model.", 1)[-1]))
    assert not torch.allclose(merged["fp32"][key], base[base_key])  # the adapter was merged into --pretrain
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["architectures"]


def test_demo_flags_reach_the_ppo_command(tmp_path):
    from rlhfkit.cli.demo import DEMO_FLAGS, build_parser, demo_argv
    from rlhfkit.cli.ppo import GROUPS
    from rlhfkit.config.parse import parse_config

    args = build_parser().parse_args(["--pretrain", "my-model", "--steps", "3", "--eval_prompts", "5",
                                      "--run_dir", str(tmp_path / "demo"), "--rollout_backend", "hf"])
    cfg = parse_config("ppo", GROUPS, demo_argv(args, tmp_path / "demo"))
    assert cfg.pretrain == "my-model" and cfg.rollout_backend == "hf" and cfg.run_dir == str(tmp_path / "demo")
    train = [json.loads(line) for line in open(cfg.prompt_data)]
    held_out = [json.loads(line) for line in open(cfg.eval_dataset)]
    # --steps 3 x rollout_batch_size prompts: exactly 3 GRPO steps of one episode; --eval_prompts 5 held out
    assert len(train) == 3 * DEMO_FLAGS["rollout_batch_size"] and len(held_out) == 5


def test_demo_run_dir_is_the_folder_its_ppo_run_writes_and_reads(tmp_path, monkeypatch, capsys):
    """`rlhfkit demo --run_dir D` (demo.main itself, which reads the flag): the data, the ppo run's --run_dir and the
    folder the summary reads are D; without the flag, runs/demo-<time> under the working folder. The ppo run is
    replaced by one that writes the three files the summary reads into the --run_dir it is given (training is not
    what this test checks; test_demo.py runs it for real)."""
    from pathlib import Path

    import rlhfkit.cli.ppo as ppo_cli
    from rlhfkit.cli import demo
    from rlhfkit.config.parse import parse_config

    handed = []

    def ppo_run(argv):
        cfg = parse_config("ppo", ppo_cli.GROUPS, argv)
        run = Path(cfg.run_dir)
        handed.append(run)
        prompt = json.loads(open(cfg.eval_dataset).readline())["input"]
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/score_mean": r, "eval/pass@1": r})
                                                   + "\n" for s, r in ((0, 0.0), (1, 1.0))))
        (run / "samples.jsonl").write_text("".join(json.dumps({"kind": "eval", "step": s, "prompt": prompt,
                                                               "response": f"answer {s}", "reward": float(s)}) + "\n"
                                                   for s in (0, 1)))
        (run / "manifest.json").write_text(json.dumps({"precision": {"dtype": "fp32", "reason": "test"}}))

    monkeypatch.setattr(ppo_cli, "main", ppo_run)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    chosen = tmp_path / "my_demo"
    got = demo.main(["--run_dir", str(chosen), "--steps", "1", "--eval_prompts", "2", "--pretrain", "m"])
    out = capsys.readouterr().out
    assert got == chosen and handed == [chosen]
    assert (chosen / "data" / "train.jsonl").is_file() and (chosen / "data" / "eval.jsonl").is_file()
    assert "before: 0.000" in out and "after:  1.000" in out and f"run folder: {chosen} " in out
    assert not (work / "runs").exists()  # nothing went to the default folder
    default = demo.main(["--steps", "1", "--eval_prompts", "2", "--pretrain", "m"])
    assert default.parent == Path("runs") and default.name.startswith("demo-") and handed[-1] == default
    assert (work / default / "data" / "train.jsonl").is_file()
