"""One run of a tiny training job with ``plan_cache=``, as a restarted job would run it.

    python tests/plan_cache_worker.py PLAN_CACHE SPILL_DIR

Launched twice by ``tests/test_plan_cache.py``: the same seeded MiniGPT, batch and SGD steps,
once without the engine and once under ``policy="auto"`` with regions. Prints one JSON line:
the losses of both runs (as float.hex, exact), the engine's profiling flag after each step's
forward, its recent stages and the final plan (``Plan.to_dict()``).
"""

from __future__ import annotations

import json
import sys

import torch

import offload
from offload.models.gpt import GPTConfig, MiniGPT
from zoo import most_profiling_steps

STEPS = most_profiling_steps("auto") + 1
"""Profiling, then a step under the final plan."""
BUDGET_MB = 0.3
"""Below what the blocks save: "auto" profiles (measure, recompute, offload trial, and their round
again where the noise decides the plan)."""
MACHINE = offload.MachineProfile(
    device_type="cpu",
    device_name="test machine",
    disk_write_gb_per_s=1.0,
    disk_read_gb_per_s=2.0,
    per_tensor_overhead_us=2.0,
)
"""Fixed figures: no probe runs, the plans do not depend on this machine's speed."""


def train(eng=None) -> tuple[list[str], list[bool]]:
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=3, n_head=2, n_embd=64, seq_len=64, attention="math"))
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    if eng is not None:
        eng = eng(model)
    losses, profiling = [], []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        if eng is None:
            _, loss = model(x, y)
        else:
            with eng:
                _, loss = model(x, y)
            profiling.append(eng.profiling)
        loss.backward()
        losses.append(loss.item().hex())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return losses, profiling, eng


def main(plan_cache: str, spill_dir: str) -> None:
    torch.set_num_threads(1)
    reference, _, _ = train()

    def make(model):
        return offload.engine(
            BUDGET_MB, regions=model.blocks, model=model, machine=MACHINE, plan_cache=plan_cache, spill_dir=spill_dir
        )

    losses, profiling, eng = train(make)
    print(
        json.dumps(
            {
                "reference": reference,
                "losses": losses,
                "profiling": profiling,
                "stages": list(eng.recent_stages),
                "plan": eng.plan.to_dict(),
            }
        )
    )
    eng.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
