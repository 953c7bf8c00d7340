"""Typed remote calls (#30): a call names the method itself (`group.call(ModelWorker.whereabouts)`,
`RemoteActors(engines, role="engine").call(RolloutEngine.ping)`), the call reaches that method on the real Ray actors,
and mypy checks the arguments and types the results (`list[R]`) from the method's signature."""

from __future__ import annotations

import inspect
import os
import textwrap
from pathlib import Path

import pytest

from rlhfkit.rl.group import ModelGroup, worker_method
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.engine_api import VLLM_ONLY, RolloutEngine
from rlhfkit.rollout.remote import RemoteActors, method_name

REPO = Path(__file__).resolve().parents[2]


def test_a_method_key_resolves_to_its_name_and_a_non_method_is_refused():
    assert method_name(ModelWorker.save_hf) == "save_hf"
    assert method_name(RolloutEngine.weight_sync_info) == "weight_sync_info"
    for not_a_method in ("save_hf", 3):  # a name as a string is refused too: no call by name is left
        with pytest.raises(TypeError, match="method of the callee's class"):
            method_name(not_a_method)  # type: ignore[arg-type]


def test_a_group_refuses_a_method_of_another_class():
    """An engine's method has a ModelWorker namesake (`whereabouts`): passing it to a model group is a mistake the
    group names instead of silently calling the worker's."""
    assert worker_method(ModelWorker.whereabouts) == "whereabouts"
    with pytest.raises(TypeError, match=r"RolloutEngine.whereabouts is not a ModelWorker method"):
        worker_method(RolloutEngine.whereabouts)


def _required(func) -> list[str]:
    return [name for name, p in inspect.signature(func).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_both_engine_classes_serve_every_method_of_the_engine_interface():
    from rlhfkit.rollout.hf_engine import HFEngine
    from rlhfkit.rollout.vllm_engine import VLLMEngine

    methods = [name for name, value in vars(RolloutEngine).items()
               if inspect.isfunction(value) and not name.startswith("_")]
    assert len(methods) >= 15 and VLLM_ONLY <= set(methods)
    for cls in (VLLMEngine, HFEngine):
        for name in methods:
            if cls is HFEngine and name in VLLM_ONLY:
                assert not hasattr(cls, name), f"{name} is served by HF engines too: drop it from VLLM_ONLY"
                continue
            assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name} (RolloutEngine.{name})"
            assert _required(getattr(cls, name)) == _required(getattr(RolloutEngine, name)), (cls.__name__, name)


def test_typed_calls_reach_the_named_method_on_real_actors(ray_cluster):
    """A one-rank reward group (no model loaded): `call` and `call_async` run the method given on the rank and return
    every rank's result; `RemoteActors` does the same for any actor class."""
    from ray.util.placement_group import remove_placement_group

    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.group import make_placement_group

    cfg = parse_config("ppo", None, ["--torch_threads_per_worker", "1"])
    pg = make_placement_group(1, 1, 0.25)
    group = ModelGroup("reward", cfg, pg, 1)
    try:
        [where] = group.call(ModelWorker.whereabouts)
        assert where["role"] == "reward" and where["rank"] == 0 and where["pid"] != os.getpid()
        assert group.call_async(ModelWorker.compute_threads).get() == [1]  # --torch_threads_per_worker 1
        with pytest.raises(TypeError, match="ModelWorker.save_hf"):
            group.call("compute_threads")  # type: ignore[arg-type]  # by name: refused, neither mypy nor a reader follows it
        assert RemoteActors(group.workers, role="reward").call(ModelWorker.whereabouts)[0]["pid"] == where["pid"]
    finally:
        group.shutdown()
        remove_placement_group(pg)


GOOD = '''
from typing import Any

import torch

from rlhfkit.rl.group import ModelGroup, Pending
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import RemoteActors


def threads(group: ModelGroup) -> list[int]:
    return group.call(ModelWorker.compute_threads)


def loaded(group: ModelGroup) -> Pending[list[int]]:
    return group.call_async(ModelWorker.init_model, "model", True, 10, 1e-6)


def resumed(group: ModelGroup) -> dict[str, Any] | None:
    return group.call(ModelWorker.load_checkpoint, "ckpt")[0]


def log_probs(group: ModelGroup, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return group.map_rows(ModelWorker.log_probs, batch)


def engine_infos(engines: list[Any]) -> list[dict[str, Any]]:
    return RemoteActors(engines, role="engine").call(RolloutEngine.weight_sync_info)
'''

BAD = '''
from typing import Any

from rlhfkit.rl.group import ModelGroup
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import RemoteActors


def wrong_result(group: ModelGroup) -> list[str]:
    found = group.call(ModelWorker.compute_threads)
    return found  # BAD-RESULT


def wrong_engine_result(engines: list[Any]) -> list[str]:
    found = RemoteActors(engines, role="engine").call(RolloutEngine.compute_threads)
    return found  # BAD-ENGINE-RESULT


def wrong_argument(group: ModelGroup) -> None:
    group.call(ModelWorker.save_hf, 3, "tok")  # BAD-ARG


def missing_argument(engines: list[Any]) -> None:
    RemoteActors(engines, role="engine").call(RolloutEngine.load_weight_bucket)  # BAD-MISSING
'''


def _mypy(tmp_path: Path, source: str) -> tuple[int, str]:
    from mypy import api

    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(source))
    out, err, status = api.run([str(path), "--config-file", str(REPO / "pyproject.toml"),
                                "--cache-dir", str(REPO / ".mypy_cache"), "--no-error-summary"])
    return status, out + err


@pytest.mark.slow  # mypy follows the package's imports: about a minute without a warm .mypy_cache
def test_mypy_types_the_results_and_checks_the_arguments_of_typed_calls(tmp_path):
    status, out = _mypy(tmp_path, GOOD)
    assert status == 0, out
    status, out = _mypy(tmp_path, BAD)
    lines = {tag: next((line for line in out.splitlines() if f":{n}:" in line), "")
             for n, tag in ((i + 1, t) for i, line in enumerate(textwrap.dedent(BAD).splitlines())
                            for t in ("BAD-RESULT", "BAD-ENGINE-RESULT", "BAD-ARG", "BAD-MISSING")
                            if f"# {t}" in line)}
    assert status == 1, out
    assert 'got "list[int]", expected "list[str]"' in lines["BAD-RESULT"], out
    assert 'got "list[int]", expected "list[str]"' in lines["BAD-ENGINE-RESULT"], out
    assert 'Argument 2 to "call" of "ModelGroup" has incompatible type "int"; expected "str"' in lines["BAD-ARG"], out
    assert "Missing positional argument" in lines["BAD-MISSING"] or "Too few arguments" in lines["BAD-MISSING"], out
