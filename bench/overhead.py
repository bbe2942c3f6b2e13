"""What the engine costs when it has nothing to do, and what moving everything costs.

    python bench/overhead.py [--device cpu|cuda] [--steps N] [--repeats R] [--json-out PATH]

Two measurements, each interleaved (A B C ... A B C ...) after a warm-up so drift hits every
variant alike, each reported as a median:

1. Per saved tensor. A chain of ``CHAIN_LENGTH`` tiny ``sin`` ops (each saves its input; all
   eligible with ``min_offload_bytes=0``), forward and backward, timed under each variant and
   without hooks. Per tensor = median over repeats of (variant - no hooks, same repeat) / chain
   length, in microseconds. Variants: identity hooks (the floor any saved_tensors_hooks user
   pays), ``torch.autograd.graph.save_on_cpu`` (pin_memory=False on the CPU, where it copies
   nothing: a reference hook pair in Python), the engine at budget None (bookkeeping only) and at
   budget 0 (every tensor to the tier and back: a spill file each on the CPU, a pooled pinned
   buffer and two copies each on CUDA).

2. Per training step: the step benchmark's own (``offload.bench.loop.Trainer``; the model in bf16
   on CUDA) without the engine and under engines at budget None, 25 % of the step's saved bytes,
   and 0 (everything to the tier). One engine per variant, reused across steps. The figure of
   merit is the overhead at budget None, the price of having the engine installed when the
   budget is not binding; the target is <= 3 %.

Prints a table and, as the last line, one JSON object with every figure, the hardware, the
versions and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layers import parse_device, set_threads  # noqa: E402

import offload  # noqa: E402
from offload.bench.config import MB, REFERENCE, RunSettings  # noqa: E402
from offload.bench.loop import Trainer  # noqa: E402
from offload.bench.measure import describe_machine, environment, median, sync, table, timed, write_json  # noqa: E402
from offload.models import load_corpus  # noqa: E402

CHAIN_LENGTH = 2000
"""Saved tensors per chain run: enough that ~1-10 us per tensor dwarfs the timer's noise."""
CHAIN_NUMEL = 16
"""Elements per chained tensor: tiny, so the op itself costs next to nothing."""
STEP_TARGET_OVERHEAD = 0.03
"""Step-time overhead allowed at budget None (3 %)."""
PARTIAL_BUDGET_FRACTION = 0.25
"""The 'partial' variant's budget, as a share of one step's saved bytes."""

GPT_PRESETS = {
    # The defaults of GPTConfig: trains in a few tens of ms per step on a small CPU.
    "cpu": RunSettings(layers=4, heads=4, hidden=128, seq=128, batch=16, dropout=0.0, device="cpu"),
    # A GPU-sized small GPT (~100M parameters) in bf16.
    "cuda": RunSettings(layers=8, heads=16, hidden=1024, seq=1024, batch=8, dropout=0.0, dtype="bf16", device="cuda"),
}


# ---------------------------------------------------------------------------------------------
# 1. per saved tensor


def _chain(x: torch.Tensor, length: int) -> None:
    y = x.clone()  # a non-leaf, so the first sin's saved input is eligible too
    for _ in range(length):
        y = y.sin()
    y.sum().backward()


def per_tensor(device: torch.device, repeats: int, warmup: int, length: int = CHAIN_LENGTH) -> dict:
    x = torch.ones(CHAIN_NUMEL, device=device, requires_grad=True)
    counting = offload.engine(budget_mb=None, min_offload_bytes=0, device=device)
    moving = offload.engine(budget_mb=0, min_offload_bytes=0, device=device)
    contexts = {
        "no hooks": contextlib.nullcontext,
        "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"),
        "engine budget None": lambda: counting,
        "engine budget 0": lambda: moving,
    }

    def run(make_context):
        def fn() -> None:
            x.grad = None
            with make_context():
                _chain(x, length)

        return fn

    fns = {name: run(ctx) for name, ctx in contexts.items()}
    times, cpu = timed(fns, rounds=repeats, warmup=warmup, device=device)
    counting.reset_stats()
    with counting:
        _chain(x, length)
    saved = counting.stats.saved_tensors
    counting.close()
    moving.close()
    if saved != length:
        raise RuntimeError(f"expected the engine to take {length} saved tensors, it took {saved}")

    base, base_cpu = times["no hooks"], cpu["no hooks"]
    variants = {}
    for name, ms in times.items():
        if name == "no hooks":
            continue
        variants[name] = {
            # median over repeats of (this variant - no hooks, same repeat), per saved tensor
            "median_us": round(median([(v - b) * 1e3 / saved for v, b in zip(ms, base)]), 3),
            # min - min: the least disturbed runs; noise (a busy neighbour) only ever adds time
            "min_us": round((min(ms) - min(base)) * 1e3 / saved, 3),
            # process CPU time: what the hooks cost when other tenants steal the wall clock
            "cpu_us": round(median([(v - b) * 1e3 / saved for v, b in zip(cpu[name], base_cpu)]), 3),
        }
    return {
        "chain_length": length,
        "numel": CHAIN_NUMEL,
        "repeats": repeats,
        "no_hooks_ms": round(median(base), 3),
        "engine_budget_none_us": variants["engine budget None"]["median_us"],
        "variants": variants,
    }


# ---------------------------------------------------------------------------------------------
# 2. per training step


def step_overhead(device: torch.device, steps: int, warmup: int, batch: Optional[int] = None) -> dict:
    settings = GPT_PRESETS["cuda" if device.type == "cuda" else "cpu"]
    settings = dataclasses.replace(settings, batch=batch or settings.batch)
    step = Trainer(settings, REFERENCE, load_corpus(), device)

    counting = offload.engine(budget_mb=None, device=device, model=step.model)
    for _ in range(warmup):
        step.step(lambda: counting)
    sync(device)
    counting.reset_stats()
    step.step(lambda: counting)
    saved = counting.stats
    partial_mb = PARTIAL_BUDGET_FRACTION * saved.saved_bytes / MB
    engines = {
        "budget None": counting,
        f"budget {partial_mb:.1f} MB (25%)": offload.engine(budget_mb=partial_mb, device=device, model=step.model),
        "budget 0": offload.engine(budget_mb=0, device=device, model=step.model),
    }
    fns = {"no engine": step.step}
    fns.update({name: (lambda e=e: step.step(lambda: e)) for name, e in engines.items()})
    for e in engines.values():
        e.reset_stats()
    times, cpu = timed(fns, rounds=steps, warmup=warmup, device=device)
    stats = {name: e.stats for name, e in engines.items()}
    for e in engines.values():
        e.close()

    base_ms = median(times["no engine"])
    base_cpu_ms = median(cpu["no engine"])
    variants = {}
    for name, ms in times.items():
        med = median(ms)
        paired = median([v / b - 1 for v, b in zip(ms, times["no engine"])])
        row = {
            "median_ms": round(med, 3),
            "min_ms": round(min(ms), 3),
            "cpu_median_ms": round(median(cpu[name]), 3),
            "overhead": round(med / base_ms - 1, 4),
            "paired_overhead": round(paired, 4),
            "min_overhead": round(min(ms) / min(times["no engine"]) - 1, 4),
            "cpu_overhead": round(median(cpu[name]) / base_cpu_ms - 1, 4),
        }
        if name in stats:
            s = stats[name]
            calls = warmup + steps
            row.update(
                offloaded_mb_per_step=round(s.offloaded_bytes / calls / MB, 2),
                peak_resident_mb=round(s.peak_resident_bytes / MB, 2),
                evict_wait_ms_per_step=round(s.evict_wait_ms / calls, 3),
                reload_wait_ms_per_step=round(s.reload_wait_ms / calls, 3),
            )
        variants[name] = row
    none_row = variants["budget None"]
    return {
        "model": dict(n_layer=settings.layers, n_embd=settings.hidden, n_head=settings.heads, seq_len=settings.seq,
                      batch=settings.batch, dtype=settings.dtype, params=step.model.num_params()),
        "steps": steps,
        "warmup": warmup,
        "saved_bytes_per_step": saved.saved_bytes,
        "saved_tensors_per_step": saved.saved_tensors,
        "passthrough_tensors_per_step": saved.passthrough_tensors,
        "no_engine_ms": round(base_ms, 3),
        "no_engine_cpu_ms": round(base_cpu_ms, 3),
        "engine_none_ms": none_row["median_ms"],
        "overhead_budget_none": none_row["overhead"],
        "cpu_overhead_budget_none": none_row["cpu_overhead"],
        "target_overhead": STEP_TARGET_OVERHEAD,
        "within_target": none_row["overhead"] <= STEP_TARGET_OVERHEAD,
        "variants": variants,
    }


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default: 30)")
    parser.add_argument("--repeats", type=int, default=15, help="timed chain runs per variant (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up runs per variant (default: 3)")
    parser.add_argument("--chain", type=int, default=CHAIN_LENGTH, help=f"saved tensors per chain run (default: {CHAIN_LENGTH})")
    parser.add_argument("--batch", type=int, default=None, help="the step's batch size (default: the device's preset)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "chain"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    device = parse_device(args.device)
    set_threads(args.threads)

    tensor = per_tensor(device, args.repeats, args.warmup, args.chain)
    step = step_overhead(device, args.steps, args.warmup, args.batch)
    env = environment(device)

    print(f"offload overhead on {describe_machine(env)}")
    print()
    print(f"per saved tensor: chain of {args.chain} sin ops on {CHAIN_NUMEL} floats, "
          f"no hooks {tensor['no_hooks_ms']:.2f} ms, median of {args.repeats} paired repeats")
    rows = [
        (name, f"{v['median_us']:.2f}", f"{v['min_us']:.2f}", f"{v['cpu_us']:.2f}")
        for name, v in tensor["variants"].items()
    ]
    print(table(("hooks", "pack+unpack us (median)", "(min)", "(cpu time)"), rows))
    print()
    m = step["model"]
    print(f"per step: MiniGPT n_layer={m['n_layer']} n_embd={m['n_embd']} seq_len={m['seq_len']} batch={m['batch']} "
          f"({m['params'] / 1e6:.1f}M params), {step['saved_tensors_per_step']} saved tensors "
          f"({step['saved_bytes_per_step'] / MB:.1f} MB) per step, median of {args.steps} interleaved steps")
    rows = [
        (name, f"{v['median_ms']:.2f}", f"{100 * v['overhead']:+.2f}%", f"{100 * v['paired_overhead']:+.2f}%",
         f"{v['min_ms']:.2f}", f"{100 * v['min_overhead']:+.2f}%",
         f"{v['cpu_median_ms']:.2f}", f"{100 * v['cpu_overhead']:+.2f}%",
         v.get("offloaded_mb_per_step", "-"), v.get("peak_resident_mb", "-"))
        for name, v in step["variants"].items()
    ]
    header = ("variant", "median ms", "overhead", "paired", "min ms", "min ovh", "cpu ms", "cpu ovh",
              "moved MB/step", "peak resident MB")
    print(table(header, rows))
    verdict = "within" if step["within_target"] else "OVER"
    print(f"\nbudget None overhead {100 * step['overhead_budget_none']:+.2f}% "
          f"({verdict} the {100 * STEP_TARGET_OVERHEAD:.0f}% target); by CPU time "
          f"{100 * step['cpu_overhead_budget_none']:+.2f}%; load average {env['load_avg_1m']} on {env['cpu_cores_logical']} cores")

    payload = {"benchmark": "overhead", "env": env, "per_tensor": tensor, "step": step}
    if args.json_out:
        write_json(args.json_out, payload)
        print(f"wrote {args.json_out}")
    print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
