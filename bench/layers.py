"""Per layer: the cost of moving its saved activations out and back, versus recomputing it.

    python bench/layers.py [--device cpu|cuda] [--sizes cpu|cuda|tiny] [--only LAYER,...] [--json-out PATH]
    pytest bench -q          # the same measurements under pytest-benchmark (test_layers.py)

What a layer measurement is (see ``LayerBench``)::

    keep       x ──fwd──▶ out ──bwd──▶ grads                      (no engine: the reference step)
    offload    x ──fwd under engine(budget 0)──▶ out ──bwd──▶     (every saved storage goes to the
                                                                   tier and comes back: disk on the
                                                                   CPU, pinned host on CUDA)
    recompute  x ──fwd, grad enabled──▶ out                        (what a recompute re-runs)

    transfer_ms  = median over rounds of (offload_i − keep_i), keep_i run just before offload_i:
                   the round trip of the layer's saved bytes, not hidden
    recompute_ms = recompute          one extra forward, as torch.utils.checkpoint would run it

The layers are the built-in model's own (``offload.models.gpt``) plus Linear, the norms and
Conv2d+BatchNorm+ReLU. This runner (no pytest-benchmark needed) and ``test_layers.py`` time the
same functions and write the same JSON (``results/layers-<device>.json`` or ``$OFFLOAD_BENCH_OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout without installing (PYTHONPATH=. works too)
    sys.path.insert(0, str(REPO_ROOT))

import offload  # noqa: E402
from offload.bench.measure import describe_machine, environment, median, sync, table, timed, write_json  # noqa: E402
from offload.models.gpt import Block, CausalSelfAttention, GPTConfig, SwiGLU  # noqa: E402

MB = 1 << 20
RESULTS_DIR = Path(__file__).resolve().parent / "results"
OUT_ENV = "OFFLOAD_BENCH_OUT"
"""Environment variable: path of the layer JSON (default ``results/layers-<device>.json``)."""
DEVICE_ENV = "OFFLOAD_BENCH_DEVICE"
"""Environment variable: device for the layer suite (default: cuda when available, else cpu)."""
SIZES_ENV = "OFFLOAD_BENCH_SIZES"
"""Environment variable: size preset: 'cpu', 'cuda' or 'tiny' (plumbing checks)."""
THREADS_ENV = "OFFLOAD_BENCH_THREADS"
"""Environment variable: torch intra-op threads (default: torch's choice)."""


def set_threads(threads: Optional[int]) -> None:
    """Pin torch's intra-op threads (None: ``$OFFLOAD_BENCH_THREADS`` or torch's default). On a
    shared machine 1 thread avoids OpenMP spin-waits against other processes."""
    threads = threads or int(os.environ.get(THREADS_ENV) or 0)
    if threads:
        torch.set_num_threads(threads)


def parse_device(name: Optional[str]) -> torch.device:
    """The device to run on, with its index when it is CUDA (tensors report ``cuda:0``, and an
    engine given a bare ``cuda`` compares device objects, so the two must be spelled alike)."""
    device = torch.device(name or os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"device {device} asked for, but torch.cuda.is_available() is False here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _gpt(dim: int, n_head: int, seq: int) -> GPTConfig:
    return GPTConfig(n_layer=1, n_head=n_head, n_embd=dim, seq_len=seq)


TOKEN_LAYERS: dict[str, Callable[[int, int, int], nn.Module]] = {
    "linear": lambda dim, n_head, seq: nn.Linear(dim, dim, bias=False),
    "swiglu_mlp": lambda dim, n_head, seq: SwiGLU(_gpt(dim, n_head, seq)),
    "attention": lambda dim, n_head, seq: CausalSelfAttention(_gpt(dim, n_head, seq)),
    "rmsnorm": lambda dim, n_head, seq: nn.RMSNorm(dim),
    "layernorm": lambda dim, n_head, seq: nn.LayerNorm(dim),
    "gpt_block": lambda dim, n_head, seq: Block(_gpt(dim, n_head, seq)),
}
"""Layers fed a (batch, seq, dim) activation: name -> builder(dim, n_head, seq)."""

IMAGE_LAYERS: dict[str, Callable[[int], nn.Module]] = {
    "conv_bn_relu": lambda ch: nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU()),
}
"""Layers fed a (batch, channels, height, width) activation: name -> builder(channels)."""


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of the layers: token shape (batch, seq, dim, heads) and image shape (batch, ch, hw)."""

    name: str
    batch: int
    seq: int
    dim: int
    n_head: int
    img_batch: int
    channels: int
    hw: int


SIZE_PRESETS: dict[str, tuple[Size, ...]] = {
    "cpu": (  # fp32 on a small CPU: the whole suite stays near a minute on 2 cores
        Size("S", batch=1, seq=256, dim=256, n_head=4, img_batch=8, channels=32, hw=32),
        Size("M", batch=2, seq=512, dim=512, n_head=8, img_batch=16, channels=64, hw=32),
        Size("L", batch=1, seq=1024, dim=768, n_head=12, img_batch=16, channels=128, hw=32),
    ),
    "cuda": (  # bf16 on one large GPU: up to a 7B-class layer (hidden 4096, seq 4096)
        Size("S", batch=1, seq=1024, dim=1024, n_head=8, img_batch=32, channels=64, hw=56),
        Size("M", batch=1, seq=4096, dim=2048, n_head=16, img_batch=64, channels=128, hw=56),
        Size("L", batch=1, seq=4096, dim=4096, n_head=32, img_batch=128, channels=256, hw=56),
    ),
    "tiny": (Size("T", batch=1, seq=32, dim=64, n_head=2, img_batch=2, channels=8, hw=8),),  # seconds
}

ROUNDS = {"cpu": (1, 7), "cuda": (2, 10)}
"""(warm-up rounds, timed rounds) per timed variant, by device type."""


@dataclasses.dataclass(frozen=True)
class Case:
    layer: str
    size: Size

    @property
    def id(self) -> str:
        return f"{self.layer}-{self.size.name}"

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.size
        return (s.img_batch, s.channels, s.hw, s.hw) if self.layer in IMAGE_LAYERS else (s.batch, s.seq, s.dim)

    def build(self) -> nn.Module:
        s = self.size
        if self.layer in IMAGE_LAYERS:
            return IMAGE_LAYERS[self.layer](s.channels)
        return TOKEN_LAYERS[self.layer](s.dim, s.n_head, s.seq)


def size_preset(device: torch.device) -> str:
    return os.environ.get(SIZES_ENV) or device.type


def cases(device: torch.device) -> list[Case]:
    preset = size_preset(device)
    if preset not in SIZE_PRESETS:
        raise ValueError(f"{SIZES_ENV}={preset!r} is not a size preset; valid: {', '.join(SIZE_PRESETS)}")
    return [Case(layer, size) for layer in list(TOKEN_LAYERS) + list(IMAGE_LAYERS) for size in SIZE_PRESETS[preset]]


def layer_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (what CPU training uses), bf16 on CUDA (what GPU training uses)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def layer_rounds(device: torch.device) -> tuple[int, int]:
    return ROUNDS.get(device.type, ROUNDS["cpu"])


class LayerBench:
    """One layer at one size on one device, and the three functions the runners time.

    The input is a non-leaf (``x_leaf.clone()``), as inside a model, so the engine may take it
    and its gradient is computed. Gradients are cleared before each step, so every step does the
    same work. The offload engine is made once and reused across steps, as in training.
    """

    KINDS = ("keep", "offload", "recompute")

    def __init__(self, case: Case, device: torch.device, seed: int = 0) -> None:
        self.case, self.device, self.dtype = case, device, layer_dtype(device)
        torch.manual_seed(seed)
        with torch.device(device):
            self.module = case.build().to(self.dtype).train()
            self.x_leaf = torch.randn(case.shape, dtype=self.dtype, requires_grad=True)
        with torch.no_grad():
            self.grad_out = torch.randn_like(self.module(self.x_leaf))
        self.engine = offload.engine(budget_mb=0, min_offload_bytes=0, device=device)

    def _zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)
        self.x_leaf.grad = None

    def keep(self) -> None:
        self._zero_grad()
        self.module(self.x_leaf.clone()).backward(self.grad_out)

    def offload(self) -> None:
        self._zero_grad()
        x = self.x_leaf.clone()
        with self.engine:
            out = self.module(x)
        out.backward(self.grad_out)

    def recompute(self) -> None:
        out = self.module(self.x_leaf.clone())  # grad enabled: builds the graph a recompute rebuilds
        del out

    def step(self, kind: str) -> Callable[[], None]:
        """The function to time for ``kind``, synchronizing the device before it returns."""
        fn = getattr(self, kind)

        def synced() -> None:
            fn()
            sync(self.device)

        return synced

    def timed(self, kind: str, into: list[float]) -> Callable[[], None]:
        """Like ``step``, timing itself: appends wall milliseconds to ``into`` (the paired reference)."""
        fn = self.step(kind)

        def timed_fn() -> None:
            sync(self.device)
            start = time.perf_counter()
            fn()
            into.append((time.perf_counter() - start) * 1e3)

        return timed_fn

    def facts(self) -> dict:
        """Untimed figures: saved bytes (engine at budget None), forward FLOPs, one offload step's stats."""
        from torch.utils.flop_counter import FlopCounterMode

        counter = offload.engine(budget_mb=None, min_offload_bytes=0, device=self.device)
        self._zero_grad()
        x = self.x_leaf.clone()
        with counter:
            out = self.module(x)
        out.backward(self.grad_out)
        del out
        saved = counter.stats
        counter.close()
        flops = FlopCounterMode(display=False)
        with flops:
            self.module(self.x_leaf.clone())
        self.engine.reset_stats()
        self.offload()
        sync(self.device)
        moved = self.engine.stats
        return {
            "saved_bytes": saved.saved_bytes, "saved_tensors": saved.saved_tensors,
            "passthrough_tensors": saved.passthrough_tensors, "fwd_flops": flops.get_total_flops(),
            "offloaded_bytes": moved.offloaded_bytes, "reloaded_bytes": moved.reloaded_bytes,
            "evict_wait_ms": round(moved.evict_wait_ms, 3), "reload_wait_ms": round(moved.reload_wait_ms, 3),
        }

    def close(self) -> None:
        self.engine.close()


def paired_difference_ms(after_ms: list[float], before_ms: list[float]) -> float:
    """Median of per-round differences: drift between rounds cancels, as the two ran back to back."""
    return median([a - b for a, b in zip(after_ms, before_ms)])


def layer_row(case: Case, device: torch.device, medians_ms: dict[str, float], transfer_ms: Optional[float],
              facts: dict) -> dict:
    """One result row: the measured medians, the derived costs and the winner. ``transfer_ms`` is
    the paired estimate; when None, the difference of the keep and offload medians stands in."""
    keep, offloaded, recompute = (medians_ms.get(k, float("nan")) for k in LayerBench.KINDS)
    transfer = offloaded - keep if transfer_ms is None else transfer_ms
    saved = facts.get("saved_bytes", 0)
    winner = ""
    if not (math.isnan(transfer) or math.isnan(recompute)):
        winner = "offload" if max(transfer, 0.0) < recompute else "recompute"
    return {
        "layer": case.layer, "size": case.size.name, "shape": list(case.shape),
        "dtype": str(layer_dtype(device)).replace("torch.", ""),
        "keep_ms": round(keep, 3), "offload_ms": round(offloaded, 3), "transfer_ms": round(transfer, 3),
        "recompute_ms": round(recompute, 3),
        "round_trip_gb_per_s": round(2 * saved / (transfer * 1e-3) / 1e9, 3) if transfer > 0 else None,
        "winner": winner, "moved_all": facts.get("offloaded_bytes") == saved, **facts,
    }


def layers_table(rows: list[dict]) -> str:
    """The human table: layer, size, saved MB, keep, transfer, recompute, winner."""
    header = ("layer", "size", "shape", "saved MB", "keep ms", "transfer ms", "recompute ms", "GB/s", "winner")
    lines = [(r["layer"], r["size"], "x".join(str(d) for d in r["shape"]), f"{r.get('saved_bytes', 0) / MB:.2f}",
              f"{r['keep_ms']:.2f}", f"{r['transfer_ms']:.2f}", f"{r['recompute_ms']:.2f}",
              r.get("round_trip_gb_per_s"), r["winner"]) for r in rows]
    out = [table(header, lines, left=3)]
    out += [f"WARNING {r['layer']} {r['size']}: the budget-0 engine moved {r.get('offloaded_bytes')} of "
            f"{r.get('saved_bytes')} saved bytes; its transfer figure is not a full round trip"
            for r in rows if not r.get("moved_all", True)]
    return "\n".join(out)


def transfer_fit(rows: list[dict]) -> Optional[dict]:
    """Least-squares fit transfer_ms ~ a * saved MB + b * saved tensors: the two numbers a cost model
    of moving needs (round-trip bandwidth and fixed cost per tensor), as this run measured them."""
    import numpy as np

    rows = [r for r in rows if r.get("saved_bytes") and not math.isnan(r["transfer_ms"])]
    if len(rows) < 3:
        return None
    a = np.array([[r["saved_bytes"] / MB, r["saved_tensors"]] for r in rows], dtype=float)
    y = np.array([r["transfer_ms"] for r in rows], dtype=float)
    (ms_per_mb, ms_per_tensor), *_ = np.linalg.lstsq(a, y, rcond=None)
    fitted = a @ np.array([ms_per_mb, ms_per_tensor])
    return {
        "ms_per_mb": round(float(ms_per_mb), 4), "ms_per_tensor": round(float(ms_per_tensor), 4),
        "round_trip_gb_per_s": round(2 * MB / 1e9 / (ms_per_mb * 1e-3), 3) if ms_per_mb > 0 else None,
        "median_abs_error_ms": round(float(np.median(np.abs(fitted - y))), 3),
    }


def describe_fit(fit: Optional[dict]) -> str:
    if not fit:
        return ""
    return (f"fit: transfer ms = {fit['ms_per_mb']:.3f} x saved MB + {fit['ms_per_tensor']:.3f} x saved tensors "
            f"(round trip {fit['round_trip_gb_per_s']} GB/s, {1e3 * fit['ms_per_tensor']:.0f} us per tensor; "
            f"median error {fit['median_abs_error_ms']} ms)")


DEFINITIONS = {
    "keep_ms": "median forward+backward without the engine",
    "offload_ms": "median forward+backward under engine(budget_mb=0, min_offload_bytes=0)",
    "transfer_ms": "median over rounds of (offload step - the keep step run just before it): "
    "unhidden round trip of the saved bytes to the tier and back",
    "recompute_ms": "median forward with grad enabled (the extra work of recomputing the layer)",
    "saved_bytes": "engine stats.saved_bytes at budget None (distinct storages, parameters excluded)",
    "round_trip_gb_per_s": "2 * saved_bytes / transfer_ms",
    "winner": "offload if max(transfer_ms, 0) < recompute_ms else recompute",
}


def layers_payload(rows: list[dict], device: torch.device, runner: str) -> dict:
    warmup, rounds = layer_rounds(device)
    return {"benchmark": "layers", "runner": runner, "size_preset": size_preset(device), "warmup_rounds": warmup,
            "rounds": rounds, "definitions": DEFINITIONS, "env": environment(device),
            "transfer_fit": transfer_fit(rows), "rows": rows}


def layers_out_path(device: torch.device) -> Path:
    return Path(os.environ.get(OUT_ENV) or RESULTS_DIR / f"layers-{device.type}.json")


def report(rows: list[dict], device: torch.device, runner: str, write: bool, say: Callable[[str], None]) -> dict:
    """Print the table and the fit through ``say``; write the JSON when ``write``. Both runners end here."""
    payload = layers_payload(rows, device, runner)
    for line in [f"layers on {describe_machine(payload['env'])}", layers_table(rows), describe_fit(payload["transfer_fit"])]:
        say(line)
    if write:
        say(f"wrote {write_json(layers_out_path(device), payload)}")
    else:
        say(f"partial run: results not written (set {OUT_ENV}=PATH to keep them)")
    return payload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--sizes", default=None, help=f"size preset: {', '.join(SIZE_PRESETS)}")
    parser.add_argument("--only", default=None, help="comma-separated layer names to run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json-out", default=None, help="where to write the JSON (default: results/layers-<device>.json)")
    args = parser.parse_args(argv)
    if args.sizes:
        os.environ[SIZES_ENV] = args.sizes
    if args.json_out:
        os.environ[OUT_ENV] = args.json_out
    device = parse_device(args.device)
    set_threads(args.threads)
    warmup, rounds = layer_rounds(device)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for case in cases(device):
        if only and case.layer not in only:
            continue
        bench = LayerBench(case, device)
        try:
            fns = {kind: bench.step(kind) for kind in LayerBench.KINDS}  # keep runs just before offload
            times, _ = timed(fns, rounds=rounds, warmup=warmup, device=device)
            facts = bench.facts()
        finally:
            bench.close()
        medians = {kind: median(ms) for kind, ms in times.items()}
        rows.append(layer_row(case, device, medians, paired_difference_ms(times["offload"], times["keep"]), facts))
        print(f"  {case.id}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()), file=sys.stderr)
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload = report(rows, device, "bench/layers.py", write=only is None or bool(args.json_out), say=print)
    print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
