"""Global normalisation across data-parallel ranks: 2 real gloo processes (FileStore in tmp_path) must give the
same statistics and advantages as one rank holding the whole batch."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from rlhfkit.algorithms import compute_advantages_and_returns, masked_whiten

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


def make_inputs(n=4, prompts=4, length=6):
    g = torch.Generator().manual_seed(0)
    b = n * prompts
    mask = torch.rand(b, length, generator=g) > 0.3
    mask[0] = False  # all-masked row
    mask[1] = torch.tensor([True] + [False] * (length - 1))  # length-1 response
    rewards = torch.randn(b, generator=g, dtype=torch.float64)
    rewards[4:8] = 0.5  # a group with zero std
    return {
        "n": n,
        "mask": mask,
        "rewards": rewards,
        "values": torch.randn(b, length, generator=g, dtype=torch.float64),
        "kl": torch.randn(b, length, generator=g, dtype=torch.float64).abs(),
        "x": torch.randn(b, length, generator=g, dtype=torch.float64) * 2 + 1,
        "splits": [(0, n), (n, b)],  # uneven: rank 0 holds one prompt, rank 1 three
    }


def run_two_ranks(tmp_path, inputs):
    torch.save(inputs, tmp_path / "inputs.pt")
    loopback = "lo0" if sys.platform == "darwin" else "lo"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": loopback, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(tmp_path / "store"), str(tmp_path / "inputs.pt"),
             str(tmp_path / f"out{rank}.pt")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    return [torch.load(tmp_path / f"out{rank}.pt") for rank in range(2)]


def joined(a, b):
    if isinstance(a, dict):
        return {k: joined(a[k], b[k]) for k in a}
    if isinstance(a, tuple):
        return tuple(joined(x, y) for x, y in zip(a, b))
    return torch.cat([a, b]) if a.dim() > 0 else a


def test_one_rank_and_two_ranks_agree(tmp_path):
    inputs = make_inputs()
    r0, r1 = run_two_ranks(tmp_path, inputs)
    split0, split1, one_rank = r0["split"], r1["split"], r0["one_rank"]
    # scalars: both ranks hold the global value
    for key in ("mean", "mean_var", "kto_z"):
        torch.testing.assert_close(split0[key], one_rank[key], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(split1[key], one_rank[key], rtol=1e-12, atol=1e-14)
    for key in one_rank["mismatch"]:
        torch.testing.assert_close(split0["mismatch"][key], one_rank["mismatch"][key], rtol=1e-12, atol=1e-14)
    # token tensors: the ranks' slices concatenate to the one-rank result
    for key in [k for k in one_rank if "/" in k] + ["whiten"]:
        torch.testing.assert_close(joined(split0[key], split1[key]), one_rank[key], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(joined(split0["whiten32"], split1["whiten32"]), one_rank["whiten32"],
                               rtol=1e-6, atol=1e-6)
    # and the distributed one-rank result equals the plain local computation
    mask, x = inputs["mask"], inputs["x"]
    torch.testing.assert_close(one_rank["whiten"], masked_whiten(x, mask), rtol=1e-12, atol=1e-12)
    local = compute_advantages_and_returns(
        "reinforce_baseline", inputs["rewards"], mask, n_samples_per_prompt=4, values=inputs["values"],
        kl=inputs["kl"], kl_coef=0.05, gamma=0.99, lambd=0.95,
    )
    torch.testing.assert_close(one_rank["reinforce_baseline/True"], local, rtol=1e-12, atol=1e-12)
    # and a per-rank (non-global) whitening would differ: the test can tell the two apart
    naive = torch.cat([masked_whiten(x[:4], mask[:4]), masked_whiten(x[4:], mask[4:])])
    assert not torch.allclose(naive, one_rank["whiten"])
