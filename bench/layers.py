"""Per layer: the cost of moving its saved activations out and back, versus recomputing it.

    python bench/layers.py [--device cpu|cuda] [--sizes cpu|cuda|tiny] [--only LAYER,...] [--json-out PATH]
                           [--time-limit-s S]
    pytest bench -q          # the same ``LayerBench`` timed by pytest-benchmark (test_layers.py)

    keep       x ──fwd──▶ out ──bwd──▶ grads              (no engine: the reference step)
    offload    the same under engine(budget 0): every saved storage to the tier and back
    recompute  x ──fwd, grad enabled──▶ out                (what a recompute re-runs)
    transfer_ms = median over rounds of (offload_i − keep_i), keep_i run just before offload_i

Each runner collects one result per case ({kind: median ms, "transfer_ms", "facts"}) and ends in
``report``, which tables them and writes the JSON. bench/README.md defines every figure.

``python bench/layers.py`` runs the smallest size of every layer first, then the next size, and
rewrites the JSON after each case (``"finished": false`` until the last); ``--time-limit-s``
skips the cases that would end past it (judged by the longest so far) and says which; SIGINT
stops it with every finished case written. On CUDA the cases' engines share one pool of pinned
slabs (``offload._memory.arena.PinnedSlabs``) instead of pinning and unpinning their own.
"""

from __future__ import annotations

import argparse
import contextlib
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
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import offload` from a checkout
import offload  # noqa: E402
from offload._memory.arena import PinnedSlabs  # noqa: E402
from offload._memory.transfer import CudaLink  # noqa: E402
from offload.bench import measure  # noqa: E402
from offload.bench.config import MB  # noqa: E402
from offload.models.gpt import Block, CausalSelfAttention, GPTConfig, SwiGLU  # noqa: E402

DEVICE_ENV = "OFFLOAD_BENCH_DEVICE"  # default: cuda when available, else cpu
SIZES_ENV = "OFFLOAD_BENCH_SIZES"  # a SIZE_PRESETS name (default: the device's type)


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of the layers: token shape (batch, seq, dim, heads) and image shape (img_batch, channels, hw)."""

    name: str
    batch: int
    seq: int
    dim: int
    n_head: int
    img_batch: int
    channels: int
    hw: int


def gpt_config(size: Size) -> GPTConfig:
    return GPTConfig(n_layer=1, n_head=size.n_head, n_embd=size.dim, seq_len=size.seq)


LAYERS: dict[str, Callable[[Size], nn.Module]] = {
    "linear": lambda s: nn.Linear(s.dim, s.dim, bias=False),
    "swiglu_mlp": lambda s: SwiGLU(gpt_config(s)),
    "attention": lambda s: CausalSelfAttention(gpt_config(s)),
    "rmsnorm": lambda s: nn.RMSNorm(s.dim),
    "layernorm": lambda s: nn.LayerNorm(s.dim),
    "gpt_block": lambda s: Block(gpt_config(s)),
    "conv_bn_relu": lambda s: nn.Sequential(
        nn.Conv2d(s.channels, s.channels, 3, padding=1, bias=False), nn.BatchNorm2d(s.channels), nn.ReLU()
    ),
}
"""name -> builder; a layer is fed a (batch, seq, dim) activation, or an image one if in IMAGE_LAYERS."""
IMAGE_LAYERS = {"conv_bn_relu"}

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

ROUNDS = {"cpu": (1, 7), "cuda": (2, 10)}  # (warm-up rounds, timed rounds) per variant
FINAL_WRITE_S = 2.0
"""Seconds ``--time-limit-s`` keeps for the last table, the JSON and giving the pinned slabs back."""
LAYER_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}  # what training uses on each device type
KINDS = ("keep", "offload", "recompute")
"""The timed variants, in timing order: each keep runs just before its offload (the paired reference)."""


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


def parse_device(name: Optional[str]) -> torch.device:
    """``name``, else ``$OFFLOAD_BENCH_DEVICE``, else cuda when available (``measure.resolve_device``)."""
    return measure.resolve_device(name or os.environ.get(DEVICE_ENV))


def size_preset(device: torch.device) -> str:
    return os.environ.get(SIZES_ENV) or device.type


def cases(device: torch.device) -> list[Case]:
    """Every layer at the smallest size, then every layer at the next: a run cut short by its time
    limit has measured every layer at some size, the cheapest first."""
    if (preset := size_preset(device)) not in SIZE_PRESETS:
        raise ValueError(f"{SIZES_ENV}={preset!r} is not a size preset; valid: {', '.join(SIZE_PRESETS)}")
    return [Case(layer, size) for size in SIZE_PRESETS[preset] for layer in LAYERS]


def layer_rounds(device: torch.device) -> tuple[int, int]:
    return ROUNDS.get(device.type, ROUNDS["cpu"])


def layer_dtype(device: torch.device) -> torch.dtype:
    return LAYER_DTYPES.get(device.type, torch.float32)


class LayerBench:
    """One layer at one size on one device, and the three functions the runners time. The input is
    a non-leaf (``x_leaf.clone()``), as inside a model; gradients are cleared before each step; the
    offload engine is made once and reused across steps, as in training; ``slabs``: the pinned
    memory it shares with the other cases' engines (CUDA)."""

    def __init__(self, case: Case, device: torch.device, seed: int = 0, slabs: Optional[PinnedSlabs] = None) -> None:
        self.case, self.device, self.dtype = case, device, layer_dtype(device)
        torch.manual_seed(seed)
        with torch.device(device):
            self.module = LAYERS[case.layer](case.size).to(self.dtype).train()
            self.x_leaf = torch.randn(case.shape, dtype=self.dtype, requires_grad=True)
        with torch.no_grad():
            self.grad_out = torch.randn_like(self.module(self.x_leaf))
        link = CudaLink(device, slabs=slabs) if slabs is not None and device.type == "cuda" else None
        self.engine = offload.engine(budget_mb=0, min_offload_bytes=0, device=device, link=link)

    def _step_under(self, engine) -> None:
        self.module.zero_grad(set_to_none=True)
        self.x_leaf.grad = None
        x = self.x_leaf.clone()
        with engine:
            out = self.module(x)
        out.backward(self.grad_out)

    def keep(self) -> None:
        self._step_under(contextlib.nullcontext())

    def offload(self) -> None:
        self._step_under(self.engine)

    def recompute(self) -> None:
        self.module(self.x_leaf.clone())  # grad enabled: builds (then drops) the graph a recompute rebuilds

    def step(self, kind: str, times_ms: Optional[list[float]] = None) -> Callable[[], None]:
        """The function to time for ``kind``, synchronizing the device before it returns; given
        ``times_ms``, it also times itself into that list (the paired reference of pytest's runner)."""

        def synced() -> None:
            measure.sync(self.device)
            start = time.perf_counter()
            getattr(self, kind)()
            measure.sync(self.device)
            if times_ms is not None:
                times_ms.append((time.perf_counter() - start) * 1e3)

        return synced

    def facts(self) -> dict:
        """Untimed figures: saved bytes (engine at budget None), forward FLOPs, one offload step's stats."""
        counter = offload.engine(budget_mb=None, min_offload_bytes=0, device=self.device)
        self._step_under(counter)
        saved = counter.stats
        counter.close()
        with (flops := FlopCounterMode(display=False)):
            self.module(self.x_leaf.clone())
        self.engine.reset_stats()
        self.offload()
        measure.sync(self.device)
        moved = self.engine.stats
        return {
            "saved_bytes": saved.saved_bytes,
            "saved_tensors": saved.saved_tensors,
            "passthrough_tensors": saved.passthrough_tensors,
            "fwd_flops": flops.get_total_flops(),
            "offloaded_bytes": moved.offloaded_bytes,
            "reloaded_bytes": moved.reloaded_bytes,
            "evict_wait_ms": round(moved.evict_wait_ms, 3),
            "reload_wait_ms": round(moved.reload_wait_ms, 3),
        }

    def close(self) -> None:
        self.engine.close()


def time_case(
    case: Case, device: torch.device, slabs: Optional[PinnedSlabs] = None, deadline: Optional[float] = None
) -> dict:
    """One case's result from the interleaved runner (``python bench/layers.py``); ``deadline``
    (``time.perf_counter()`` seconds) cuts its timed rounds short (``measure.timed``)."""
    warmup, rounds = layer_rounds(device)
    bench = LayerBench(case, device, slabs=slabs)
    try:
        steps = {kind: bench.step(kind) for kind in KINDS}
        times, _ = measure.timed(steps, rounds=rounds, warmup=warmup, device=device, deadline=deadline)
        facts = bench.facts()
    finally:
        bench.close()
    medians = {kind: measure.median(ms) for kind, ms in times.items()}
    return medians | {"transfer_ms": measure.paired_median(times["offload"], times["keep"]), "facts": facts}


def layer_row(case: Case, device: torch.device, result: dict) -> dict:
    """One JSON row: the measured medians, the derived costs and the winner. Without the paired
    ``transfer_ms`` (its offload round not run), the difference of the keep and offload medians stands in."""
    keep, offloaded, recompute = (result.get(kind, math.nan) for kind in KINDS)
    transfer = result.get("transfer_ms", offloaded - keep)
    facts = result.get("facts", {})
    saved = facts.get("saved_bytes", 0)
    if math.isnan(transfer) or math.isnan(recompute):
        winner = ""
    else:
        winner = "offload" if max(transfer, 0.0) < recompute else "recompute"
    return {
        "layer": case.layer,
        "size": case.size.name,
        "shape": list(case.shape),
        "dtype": str(layer_dtype(device)).replace("torch.", ""),
        "keep_ms": round(keep, 3),
        "offload_ms": round(offloaded, 3),
        "transfer_ms": round(transfer, 3),
        "recompute_ms": round(recompute, 3),
        "round_trip_gb_per_s": round(2 * saved / (transfer * 1e-3) / 1e9, 3) if transfer > 0 else None,
        "winner": winner,
        "moved_all": facts.get("offloaded_bytes") == saved,
        **facts,
    }


def transfer_fit(rows: list[dict]) -> Optional[dict]:
    """Least-squares fit transfer_ms ~ a * saved MB + b * saved tensors: the two numbers a cost model
    of moving needs (round-trip bandwidth and fixed cost per tensor), as this run measured them."""
    rows = [r for r in rows if r.get("saved_bytes") and not math.isnan(r["transfer_ms"])]
    if len(rows) < 3:
        return None
    a = torch.tensor([[r["saved_bytes"] / MB, r["saved_tensors"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([[r["transfer_ms"]] for r in rows], dtype=torch.float64)
    coefficients = torch.linalg.lstsq(a, y).solution
    ms_per_mb, ms_per_tensor = coefficients.flatten().tolist()
    return {
        "ms_per_mb": round(ms_per_mb, 4),
        "ms_per_tensor": round(ms_per_tensor, 4),
        "round_trip_gb_per_s": round(2 * MB / 1e9 / (ms_per_mb * 1e-3), 3) if ms_per_mb > 0 else None,
        "median_abs_error_ms": round(float((a @ coefficients - y).abs().median()), 3),
    }


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

COLUMNS: list[measure.Column] = [
    ("layer", "layer", ""),
    ("size", "size", ""),
    ("shape", lambda row: "x".join(map(str, row["shape"])), ""),
    ("saved MB", lambda row: row.get("saved_bytes", 0) / MB, ".2f"),
    ("keep ms", "keep_ms", ".2f"),
    ("transfer ms", "transfer_ms", ".2f"),
    ("recompute ms", "recompute_ms", ".2f"),
    ("GB/s", "round_trip_gb_per_s", ""),
    ("winner", "winner", ""),
]


def report(
    results: dict[Case, dict],
    device: torch.device,
    runner: str,
    say: Callable[[str], None],
    json_out: Optional[Path] = None,
    finished: bool = True,
    skipped: Optional[dict[str, str]] = None,
) -> dict:
    """Table the results and the fit through ``say``, and write the JSON to ``json_out``, by default
    ``layers-<device>.json`` under ``$OFFLOAD_BENCH_OUT`` (else ``out/bench``), never into the
    committed bench/results/ unless ``json_out`` was checked with ``--overwrite-results``.
    ``finished``: every case asked for ran or was skipped (``skipped``: case id -> why)."""
    rows = [layer_row(case, device, result) for case, result in results.items()]
    warmup, rounds = layer_rounds(device)
    fit = transfer_fit(rows)
    env = measure.environment(device)
    payload = {
        "benchmark": "layers",
        "runner": runner,
        "size_preset": size_preset(device),
        "warmup_rounds": warmup,
        "rounds": rounds,
        "definitions": DEFINITIONS,
        "env": env,
        "transfer_fit": fit,
        "rows": rows,
        "finished": finished,
        "skipped": skipped or {},
    }
    say(f"layers on {measure.describe_machine(env)}")
    say(measure.records_table(COLUMNS, rows, left=3))
    for row in rows:
        if not row["moved_all"]:
            say(
                f"WARNING {row['layer']} {row['size']}: the budget-0 engine moved {row.get('offloaded_bytes')} of "
                f"{row.get('saved_bytes')} saved bytes; its transfer figure is not a full round trip"
            )
    if fit:
        say(
            f"fit: transfer ms = {fit['ms_per_mb']:.3f} x saved MB + {fit['ms_per_tensor']:.3f} x saved tensors "
            f"(round trip {fit['round_trip_gb_per_s']} GB/s, {1e3 * fit['ms_per_tensor']:.0f} us per tensor; "
            f"median error {fit['median_abs_error_ms']} ms)"
        )
    out = json_out or measure.check_out(measure.out_dir() / f"layers-{device.type}.json")
    say(f"wrote {measure.write_json(out, payload)}")
    return payload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--sizes", help=f"size preset: {', '.join(SIZE_PRESETS)}")
    parser.add_argument("--only", help="comma-separated layer names to run")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--json-out",
        type=Path,
        help=f"where to write the JSON (default: ${measure.OUT_ENV}/layers-<device>.json, else out/bench/...)",
    )
    parser.add_argument(
        "--overwrite-results", action="store_true", help="let --json-out replace a committed file in bench/results/"
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        help="skip the cases that would end past this many seconds from the start (judged by the longest so far)",
    )
    args = parser.parse_args(argv)
    try:
        json_out = None if args.json_out is None else measure.check_out(args.json_out, args.overwrite_results)
    except ValueError as error:
        parser.error(str(error))
    if args.sizes:
        os.environ[SIZES_ENV] = args.sizes
    started = time.perf_counter()
    deadline = None if args.time_limit_s is None else started + args.time_limit_s - FINAL_WRITE_S
    device = parse_device(args.device)
    measure.set_threads(args.threads)
    measure.remember_sigint()
    only = set(args.only.split(",")) if args.only else None
    todo = [case for case in cases(device) if not only or case.layer in only]
    results: dict[Case, dict] = {}
    skipped: dict[str, str] = {}
    slabs = PinnedSlabs() if device.type == "cuda" else None  # one pool of pinned slabs for every case
    longest_s = 0.0

    def partial() -> None:  # after each case: a time limit or SIGINT keeps what was measured
        report(results, device, "bench/layers.py", say=lambda line: None, json_out=json_out, finished=False)

    try:
        for index, case in enumerate(todo):
            if deadline is not None and time.perf_counter() + longest_s > deadline:
                why = f"not run: it would pass the time limit (longest case {longest_s:.1f} s)"
                skipped.update({later.id: why for later in todo[index:]})
                break
            case_started = time.perf_counter()
            results[case] = time_case(case, device, slabs, deadline)
            longest_s = max(longest_s, time.perf_counter() - case_started)
            print(f"  {case.id}: " + ", ".join(f"{k} {results[case][k]:.2f} ms" for k in KINDS), file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            partial()
    except KeyboardInterrupt:  # a part's timeout (SIGINT): the JSON holds every case that finished
        print(f"layers: interrupted after {len(results)} of {len(todo)} cases", file=sys.stderr)
        return 130
    finally:
        if slabs is not None:
            slabs.clear(settle=torch.cuda.synchronize)
    payload = report(results, device, "bench/layers.py", say=print, json_out=json_out, skipped=skipped)
    for case_id, why in skipped.items():
        print(f"layers: skipped {case_id}: {why}", file=sys.stderr)
    print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
