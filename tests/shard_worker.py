"""One rank of a Megatron-style tensor-parallel stack under the engine, saves shared across the group.

Run by ``tests/test_sharded.py`` (and ``bench/sharded.py``) under torchrun on gloo:

    python -m torch.distributed.run --standalone --nproc-per-node=N tests/shard_worker.py OUT [--width W]

Each block: a LayerNorm (replicated), a column-parallel linear (this rank's rows of the full
weight), GELU, a row-parallel linear (its columns) and an all-reduce of the partial sums, with
Megatron's f (identity forward, all-reduce backward) in front of the column-parallel linear. The
norm's input and output are the same on every rank: those are the saves declared shared, either
by the block itself (``offload.sharded``) or by the engine for regions run as recompute
(``shared_inputs=``). The math is identical with and without the engine (the collectives sum the
same values in the same order), so every rank's gradients are compared with ``torch.equal``
against its own run without the engine. Results go to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import offload  # noqa: E402

SEQS = (48, 64, 40, 56)
"""Tokens per step: the shape changes every step, as with dynamic padding."""
BATCH = 2


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the input's gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward all-reduces the partial sums; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Block(torch.nn.Module):
    def __init__(self, width: int, world: int, rank: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        hidden = 4 * width
        w1 = torch.randn(hidden, width, generator=g) / width**0.5
        w2 = torch.randn(width, hidden, generator=g) / hidden**0.5
        part = hidden // world
        self.norm = torch.nn.LayerNorm(width)
        self.w1 = torch.nn.Parameter(w1[rank * part : (rank + 1) * part].clone())  # column-parallel
        self.b1 = torch.nn.Parameter(torch.zeros(part))
        self.w2 = torch.nn.Parameter(w2[:, rank * part : (rank + 1) * part].clone())  # row-parallel
        self.b2 = torch.nn.Parameter(torch.zeros(width))
        self.declare = None  # a context factory for the saves every rank makes alike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.declare() if self.declare is not None else contextlib.nullcontext():
            h = _CopyToParallel.apply(self.norm(x))  # the norm saves x, its mean and rstd: replicated
            z = F.linear(h, self.w1, self.b1)  # saves h: replicated
        a = F.gelu(z)  # saves z: this rank's own
        y = _ReduceFromParallel.apply(F.linear(a, self.w2))  # saves a: this rank's own
        return x + y + self.b2


class Stack(torch.nn.Module):
    def __init__(self, width: int, layers: int, world: int, rank: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width, world, rank, seed=100 + i) for i in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def run(model: Stack, width: int, eng, declare, steps: int) -> dict:
    for block in model.blocks:
        block.declare = declare
    grads, step_ms = [], []
    for step in range(steps):
        seq = SEQS[step % len(SEQS)] + 8 * (step // len(SEQS))
        x = torch.randn(BATCH, seq, width, generator=torch.Generator().manual_seed(step), requires_grad=True)
        model.zero_grad(set_to_none=True)
        if eng is not None:
            eng.count_next_step()  # budget None counts every step here: its bytes are the oracle
        dist.barrier()
        start = time.perf_counter()
        with eng if eng is not None else contextlib.nullcontext():
            loss = model(x)
        loss.backward()
        step_ms.append((time.perf_counter() - start) * 1e3)
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
    return {"grads": grads, "step_ms": step_ms}


def extras(width: int) -> dict:
    """The edges: a save that differs between ranks under verify=True, one smaller than the group,
    two views of one storage, a declared save modified in place before backward."""
    world = dist.group.WORLD
    out: dict = {}
    bad = Stack(width, 1, dist.get_world_size(), dist.get_rank())
    x = torch.randn(BATCH, SEQS[0], width, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with offload.engine(None, model=bad, min_offload_mb=0) as eng:
        try:
            with offload.sharded(world, verify=True):
                torch.tanh(x * bad.blocks[0].w1.sum(0)[:width])  # differs by rank: each holds other rows of w1
            out["mismatch"] = "no error"
        except offload.OffloadError as error:
            out["mismatch"] = str(error)
    eng.close()

    auto = Stack(width, 2, dist.get_world_size(), dist.get_rank())
    for block in auto.blocks:
        block.declare = lambda: offload.sharded(world)
    eng = offload.engine(1, regions=auto.blocks, policy="auto", model=auto, min_offload_mb=0)
    try:
        with eng:
            auto(x.detach())
        out["under_auto"] = "no error"
    except offload.OffloadError as error:
        out["under_auto"] = str(error)
    eng.close()

    m = torch.ones(1, requires_grad=True)
    eng = offload.engine(None, min_offload_mb=0)
    with eng, offload.sharded(world):
        mask = m.detach() > 0  # a 1-byte bool storage: smaller than the group
        loss = torch.where(mask, m * 2, m * 3).sum()
    loss.backward()
    out["tiny"] = {"shared_bytes": eng.stats.shared_bytes, "saved_bytes": eng.stats.saved_bytes, "grad": m.grad.item()}
    eng.close()

    y = torch.randn(4, 2 * width, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want = torch.autograd.grad((lambda h: (h[:, :width] * h[:, width:]).sum())(y * 1.5), y)[0]
    eng = offload.engine(None, min_offload_mb=0)
    with eng, offload.sharded(world, verify=True):
        h = y * 1.5
        loss = (h[:, :width] * h[:, width:]).sum()  # mul saves both halves: two views of h's storage
    got = torch.autograd.grad(loss, y)[0]
    out["views"] = {
        "exact": bool(torch.equal(got, want)),
        "storage_bytes": h.untyped_storage().nbytes(),
        "shared_bytes": eng.stats.shared_bytes,
        "gathered_bytes": eng.stats.gathered_bytes,
    }
    eng.close()

    eng = offload.engine(None, min_offload_mb=0)
    out["inplace"] = "no error"
    with eng, offload.sharded(world):
        e = y.exp()
        loss = e.sin().sum()  # sin saves e
    e.add_(1)
    try:
        loss.backward()
    except RuntimeError as error:
        out["inplace"] = str(error)
    eng.close()
    out["one_way"] = _shared_inputs_two_ways(width, world)
    return out


def _shared_inputs_two_ways(width: int, world) -> dict:
    """The recomputed regions' inputs declared two ways, at budget 0: ``shared_inputs=`` (deprecated)
    and ``offload.sharded(group)`` around the regions' calls (the one way its warning names)."""
    results = {}
    for way in ("shared_inputs", "sharded"):
        torch.manual_seed(0)
        model = Stack(width, 2, dist.get_world_size(), dist.get_rank())
        options: dict = {"regions": model.blocks, "policy": "recompute", "model": model, "min_offload_mb": 0}
        if way == "shared_inputs":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                eng = offload.engine(0, shared_inputs=world, **options)
        else:
            eng = offload.engine(0, **options)
        x = torch.randn(BATCH, SEQS[0], width, generator=torch.Generator().manual_seed(3), requires_grad=True)
        with eng:
            with offload.sharded(world) if way == "sharded" else contextlib.nullcontext():
                h = x
                for block in model.blocks:
                    h = block(h)
            loss = h.square().mean()
        loss.backward()
        stats = eng.stats
        results[way] = {
            "grads": [p.grad.clone() for p in model.parameters()] + [x.grad.clone()],
            "shared_bytes": stats.shared_bytes,
            "shared_kept_bytes": stats.shared_kept_bytes,
        }
        eng.close()
    old, new = results["shared_inputs"], results["sharded"]
    return {
        "exact": all(torch.equal(a, b) for a, b in zip(old.pop("grads"), new.pop("grads"), strict=True)),
        "shared_inputs": old,
        "sharded": new,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--budgets", default="none,0,small")
    parser.add_argument("--steps", type=int, default=len(SEQS))
    parser.add_argument("--min-offload-bytes", type=int, default=0, help="the engines' min_offload_bytes")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="time the saves without checksums")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Stack(args.width, args.layers, world, rank)
    results: dict = {"world": world, "rank": rank, "configs": {}}
    reference = run(model, args.width, None, None, args.steps)
    saved_whole = None
    for budget_name in args.budgets.split(","):
        for mode in ("declared", "recompute"):
            for shared in (False, True):
                if budget_name == "small":
                    assert saved_whole is not None
                    budget = 0.3 * saved_whole / (1 << 20)  # a third of what the blocks save unshared
                else:
                    budget = None if budget_name == "none" else float(budget_name)
                group = dist.group.WORLD
                options: dict = {"min_offload_bytes": args.min_offload_bytes}
                if mode == "recompute":
                    options.update(regions=model.blocks, policy="recompute", model=model)
                    if shared:
                        options["shared_inputs"] = group
                    declare = None
                else:
                    options["model"] = model
                    declare = (lambda g=group: offload.sharded(g, verify=args.verify)) if shared else None
                eng = offload.engine(budget, **options)
                got = run(model, args.width, eng, declare, args.steps)
                stats = eng.stats
                eng.close()
                if budget_name == "none" and mode == "declared" and not shared:
                    saved_whole = stats.saved_bytes / args.steps
                exact = all(
                    torch.equal(a, b)
                    for step_got, step_want in zip(got["grads"], reference["grads"], strict=True)
                    for a, b in zip(step_got, step_want, strict=True)
                )
                results["configs"][f"{budget_name}/{mode}/{'shared' if shared else 'whole'}"] = {
                    "budget_mb": budget,
                    "exact": exact,
                    "stats": stats.to_dict(),
                    "step_ms": got["step_ms"],
                    "reference_step_ms": reference["step_ms"],
                }
    results.update(extras(args.width))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
