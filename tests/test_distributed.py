"""The engine inside each rank of DDP and FSDP2: gradients bitwise equal to the run without it.

Two CPU processes on the gloo backend, launched with torchrun (``--standalone``: the rendezvous
binds port 0, so the OS picks a free port and parallel test runs cannot collide). The ranks run
``tests/dist_worker.py``, which trains a small residual MLP for two steps per configuration
(no engine, then budgets None / 0 / 50 KiB with one engine per rank) and saves every full
gradient. The math is identical with and without the engine (the engine only moves saved
tensors; the collectives sum the same values in the same order), so gradients are compared with
``torch.equal``.

Under FSDP2 the parameters are DTensors, but forward and backward run on the all-gathered plain
tensors, so the engine sees plain activations and (as parameters) skips the unsharded weights.
A direct DTensor computation under the engine checks that DTensor saves pass through untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH_TIMEOUT_S = 180
"""Two ranks start in ~5 s and finish both modes in ~15 s on 2 idle cores; room for a busy host."""
BUDGETS_MB = (None, 0, 0.05)  # as in dist_worker.BUDGETS_MB
WORLD = 2


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this build",
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Run the worker once for both modes; (output dir, launcher's exit code and output)."""
    out_dir = tmp_path_factory.mktemp("dist")
    modes = ["ddp"] + (["fsdp"] if _has_fsdp2() else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        str(WORKER),
        str(out_dir),
        *modes,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return out_dir, proc.returncode, (proc.stdout + proc.stderr)[-4000:]


def _results(launched, mode: str) -> list[dict]:
    out_dir, returncode, output = launched
    files = [out_dir / f"{mode}_rank{r}.pt" for r in range(WORLD)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"{mode}: ranks wrote no results {missing} (torchrun exit {returncode}):\n{output}"
    return [torch.load(f, weights_only=False) for f in files]


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        reference = res["reference"]["grads"]
        assert all(g.abs().sum() > 0 for step in reference for g in step.values()), "reference gradients are zero"
        for budget in BUDGETS_MB:
            run = res[budget]
            for step, (want, got) in enumerate(zip(reference, run["grads"], strict=True)):
                assert want.keys() == got.keys()
                for name in want:
                    assert torch.equal(want[name], got[name]), (
                        f"rank {rank} budget {budget} step {step}: {name} differs"
                    )
            stats = run["stats"]
            assert stats["saved_tensors"] > 0 and stats["passthrough_tensors"] > 0  # activations in, weights out
            if budget == 0:
                assert stats["offloaded_bytes"] == stats["saved_bytes"] and stats["peak_resident_bytes"] == 0
            elif budget is not None:
                assert 0 < stats["offloaded_bytes"] < stats["saved_bytes"]
                assert stats["peak_resident_bytes"] <= budget * 2**20
            assert stats["resident_bytes"] == 0 and stats["spill_bytes"] == 0  # all released after backward
    for name in results[0]["reference"]["grads"][0]:  # every rank holds the same full gradient
        assert torch.equal(results[0]["reference"]["grads"][0][name], results[1]["reference"]["grads"][0][name])


@pytest.mark.slow  # a process group of worker processes
def test_ddp(launched):
    _check(_results(launched, "ddp"))


@pytest.mark.slow  # a process group of worker processes
@pytest.mark.skipif(not _has_fsdp2(), reason="torch.distributed.fsdp.fully_shard (FSDP2) needs torch >= 2.6")
def test_fsdp2(launched):
    results = _results(launched, "fsdp")
    _check(results)
    for res in results:
        dtensor = res["dtensor"]
        assert dtensor["equal"], "a DTensor computation under the engine changed its gradient"
        assert dtensor["stats"]["saved_tensors"] == 0 and dtensor["stats"]["passthrough_tensors"] > 0
