"""One rank of the distributed tests: the same training steps with and without the engine.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_worker.py OUT_DIR ddp fsdp

Launched by ``tests/test_distributed.py``. Each rank builds the same seeded model, wraps it in
DDP or FSDP2 (``fully_shard``), and trains ``STEPS`` steps on its own shard of the batch, once
without the engine and once per budget with one engine per rank. After each backward it records
every parameter's full gradient (FSDP2: the sharded DTensor gathered with ``full_tensor()``),
and at the end the engine's stats; rank r writes them to ``OUT_DIR/{mode}_rank{r}.pt`` as soon as
that mode is done, so one mode failing leaves the other's results. The test compares each
engine run with the reference run.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import offload

STEPS = 2
BATCH_PER_RANK = 32
WIDTH = 128
DEPTH = 3
MIN_OFFLOAD_BYTES = 1024
"""Below the default 64 KiB so these small activations (32 x 128 fp32 = 16 KiB) are moved."""
BUDGETS_MB = (None, 0, 0.05)
"""Count only; move everything eligible; about three activations (50 KiB) stay on the device."""
LR = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).square().mean()


def wrap(model: nn.Module, mode: str) -> nn.Module:
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, on every rank (a collective under FSDP2)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # DTensor: this rank holds a shard
            g = g.full_tensor()
        out[name] = g.detach().clone()
    return out


def train(base: nn.Module, mode: str, budget_mb) -> dict:
    model = wrap(copy.deepcopy(base), mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    eng = None
    if budget_mb != "off":
        eng = offload.engine(budget_mb=budget_mb, min_offload_bytes=MIN_OFFLOAD_BYTES, model=model)
    rank = dist.get_rank()
    grads = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        x = torch.randn(BATCH_PER_RANK, WIDTH, generator=gen)
        if eng is not None:
            with eng:
                loss = model(x)
        else:
            loss = model(x)
        loss.backward()
        grads.append(full_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result = {"grads": grads, "stats": None}
    if eng is not None:
        result["stats"] = eng.stats.to_dict()
        eng.close()
    return result


def dtensor_saves() -> dict:
    """A DTensor computation under the engine: its saves are DTensors and must pass through."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = distribute_tensor(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(0)), mesh, [Replicate()])
    w.requires_grad_(True)
    x = distribute_tensor(
        torch.randn(BATCH_PER_RANK, WIDTH, generator=torch.Generator().manual_seed(1)), mesh, [Replicate()]
    )
    x.requires_grad_(True)
    eng = offload.engine(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES)
    with eng:
        loss = F.gelu(x @ w).sum()
    loss.backward()
    grad_engine = w.grad.full_tensor().clone()
    stats = eng.stats.to_dict()
    eng.close()
    w.grad = None
    F.gelu(x @ w).sum().backward()
    return {"equal": torch.equal(grad_engine, w.grad.full_tensor()), "stats": stats}


def main() -> None:
    out_dir, modes = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    for mode in modes:
        torch.manual_seed(0)
        base = Net()
        results = {"mode": mode, "reference": train(base, mode, "off")}
        for budget in BUDGETS_MB:
            results[budget] = train(base, mode, budget)
        if mode == "fsdp":
            results["dtensor"] = dtensor_saves()
        torch.save(results, os.path.join(out_dir, f"{mode}_rank{dist.get_rank()}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
