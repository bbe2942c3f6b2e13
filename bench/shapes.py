"""Loops whose shapes change: memory at rest per shape, a dynamic-padding soak, derived plans
against measured profiles, and auto against the best fixed policy in the same loop.

    python bench/shapes.py leak    [--steps-per-shape 4]
    python bench/shapes.py soak    [--steps 500]
    python bench/shapes.py derive  [--shapes 12] [--rounds 5]
    python bench/shapes.py pair    [--rounds 5]
    python bench/shapes.py fixed   [--rounds 5]
    python bench/shapes.py curve   [--rounds 5]
    python bench/shapes.py all

leak    MiniGPT 8 x 256, batch 4, budget 20 MB, policy "auto" over its blocks: four steps at each
        sequence length 128, 160, 192, 224, 256, then 128 and 160 again; the process's resident
        set at rest after each shape (gc, malloc_trim) and the bytes of live tensors.
soak    Hugging Face's Trainer on a tiny Llama (4 layers, width 256) with a padding collator
        (lengths 64-512, each batch padded to its longest), regions="auto", a fixed budget and
        budget "auto" on a device of fixed size whose memory in use is what this process has
        allocated from malloc (sized to the fixed run's peak, sampled, plus the fixed budget and a
        reserve of the same size); against the same
        run without the callback: losses bitwise, profiling steps, every step's peak against the
        budget in force, RSS at rest each step.
derive  MiniGPT and the tiny Llama: an engine trained over a few lengths plans lengths it never
        measured from its fit; a fresh engine profiling each of those lengths measures them. Saved
        bytes and forward ms per region, and the derived plan's predicted step against steps timed
        under it: as the engine read it when the length's first step began (at the pace of the
        steps under plans before it), and the cost model's alone. Each round trains a new engine,
        takes every length in a rotated order, then profiles each with a fresh engine, so both
        sides of a length come from one round; medians over the rounds.
pair    The dynamic-padding loop on MiniGPT under "auto" and under each fixed policy at the same
        budget, after their profiling, interleaved step by step (every policy takes each length in
        turn, the order rotated): step time of auto over the best fixed policy, the median of
        per-round ratios; the JSON also holds auto's plans and its link calibration.

fixed   MiniGPT 8 x 256, batch 4, one sequence length (256), budget 40 MB: the process's peak
        resident set over its rest without the engine, under "offload" and under "auto" (each in
        its own process, rounds interleaved), over the first 8 steps (profiling included) and
        over 3 steps under the plan.
curve   One MiniGPT block and one tiny-Llama layer alone, no engine, at derive's lengths,
        interleaved: forward ms per token by length (is what the fits follow smooth?).

Each part prints a table and ends with one JSON line; the JSON goes to
``$OFFLOAD_BENCH_OUT/shapes-<part>.json`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import ctypes
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import offload` from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench's shared modules, also when loaded by path

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import offload  # noqa: E402
from hf_models import cpu_trainer_args, tiny_llama  # noqa: E402
from offload._plan.fit import (  # noqa: E402
    BYTE_BASES,
    BYTE_TOLERANCE,
    TIME_BASES,
    TIME_TOLERANCE,
    FieldFit,
    Shape,
)
from offload._regions.selective import flop_formula  # noqa: E402
from offload.bench.measure import check_out, environment, median, out_dir, table, write_json  # noqa: E402
from offload.bench.padding import Ragged, pad_to_longest  # noqa: E402
from offload.models import GPTConfig, MiniGPT  # noqa: E402
from process_memory import rest_rss  # noqa: E402

MB = 1 << 20
TRAIN_LENGTHS = (250, 250, 250, 131, 389, 509)
"""derive: the lengths an engine is trained on, lengths a dynamic-padding loop might see first. Not
powers of two: on this CPU a step at 256 or 512 runs 5-10 % faster a token than at its neighbours
(the tiny Llama, no engine, 2026-12-03: 119 us a token at 256 against 131 at 250, 139 at 512 against
146 at 509), so a fit trained on them priced every other length low."""
STEPS_UNDER_PLAN = 3
"""derive: steps under each derived plan per round (the first, which allocates the new shape, not timed)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc


def _mallinfo2() -> _MallInfo2:
    return _libc().mallinfo2()


def heap_in_use() -> int:
    """Bytes this process has allocated from malloc now, in every arena and mmapped chunk (glibc's
    ``mallinfo2``): what a device's allocator would count as allocated, freed blocks it keeps aside."""
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


def live_tensor_bytes() -> int:
    gc.collect()
    return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if type(o) is torch.Tensor)


def minigpt(layers: int = 8, width: int = 256, seq: int = 512, seed: int = 0) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(GPTConfig(n_layer=layers, n_embd=width, n_head=4, seq_len=seq, dropout=0.0))


def gpt_step(model: MiniGPT, seq: int, batch: int, step: int, eng: Optional[offload.Engine]) -> float:
    """One forward and backward at ``seq``; returns the loss (the batch is fixed by ``step``)."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=g)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(step)
    if eng is None:
        _, loss = model(idx[:, :-1], idx[:, 1:])
    else:
        with eng:
            _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.item()


def emit(part: str, rows_text: str, payload: dict) -> dict:
    payload = {"part": part, "env": environment(torch.device("cpu")), **payload}
    print(rows_text)
    path = write_json(check_out(out_dir() / f"shapes-{part}.json"), payload)
    print(f"(written to {path})")
    print(json.dumps(payload, default=str))
    return payload


# ---------------------------------------------------------------------------------------- leak


def part_leak(args: argparse.Namespace) -> dict:
    model = minigpt()
    eng = offload.engine(20, policy="auto", regions=model.blocks, model=model)
    base_rss, base_live = rest_rss(), live_tensor_bytes()
    rows, records = [], []
    step = 0
    for seq in (128, 160, 192, 224, 256, 128, 160):
        for _ in range(args.steps_per_shape):
            gpt_step(model, seq, 4, step, eng)
            step += 1
        rss, live = rest_rss(), live_tensor_bytes()
        stages = list(eng.recent_stages)[-args.steps_per_shape :]
        records.append({"seq": seq, "rss_mb": (rss - base_rss) / MB, "live_tensor_mb": live / MB, "stages": stages})
        rows.append([seq, f"+{(rss - base_rss) / MB:.1f}", f"{live / MB:.1f}", " ".join(s or "-" for s in stages)])
    eng.close()
    after_first = [r["rss_mb"] for r in records[1:]]
    flat = (max(after_first) - min(after_first)) * MB / (base_rss + min(after_first) * MB)
    text = table(["seq", "RSS at rest, MB over start", "live tensors MB (not parameters)", "stages"], rows)
    text += f"\nstart RSS {base_rss / MB:.0f} MB (live tensors, parameters aside: {base_live / MB:.1f} MB); "
    text += f"spread of RSS at rest after the first shape: {100 * flat:.2f} % of RSS"
    return emit("leak", text, {"start_rss_mb": base_rss / MB, "shapes": records, "rest_rss_spread": flat})


# ---------------------------------------------------------------------------------------- soak


def part_soak(args: argparse.Namespace) -> dict:
    import transformers

    from offload.integrations.hf import OffloadCallback

    batch = 4
    data = Ragged(args.steps * batch, 64, 512, vocab=512)
    base = tiny_llama()

    # The fixed budget: a quarter of what the model saves at a middle length, counted once.
    model = copy.deepcopy(base)
    counting = offload.engine(None, model=model)
    ids = torch.randint(1, 512, (batch, 288))
    with counting:
        loss = model(input_ids=ids, labels=ids).loss
    budget_mb = round(0.25 * counting.stats.saved_bytes / MB, 1)
    del loss
    counting.close()

    class Watch(transformers.TrainerCallback):
        """Per step: its stage, its peak against the budget in force, the RSS at rest."""

        def __init__(self, offload_callback: Optional[Any]) -> None:
            self.offload_callback = offload_callback
            self.steps: list[dict] = []

        def on_step_end(self, args_, state, control, **kwargs):
            record: dict = {"rss": rest_rss(), "heap": heap_in_use()}
            if self.offload_callback is not None:
                eng = self.offload_callback.engine
                stats = eng.stats
                record.update(
                    stage=eng.recent_stages[-1] if eng.recent_stages else None,
                    peak=stats.peak_resident_bytes,
                    over=stats.peak_over_budget_bytes,
                    budget=stats.budget_bytes,
                )
                eng.reset_stats()  # the peak per step; the callback logs its figures from differences
            self.steps.append(record)

    def run(engine_kwargs: Optional[dict]) -> dict:
        model = copy.deepcopy(base)
        offload_callback = None if engine_kwargs is None else OffloadCallback(regions="auto", **engine_kwargs)
        watch = Watch(offload_callback)
        callbacks = [c for c in (offload_callback, watch) if c is not None]
        with tempfile.TemporaryDirectory() as out:
            trainer = transformers.Trainer(
                model=model,
                args=cpu_trainer_args(out, batch, learning_rate=1e-3, logging_steps=1),
                train_dataset=data,
                data_collator=pad_to_longest,
                callbacks=callbacks,
            )
            start = time.perf_counter()
            with _HeapPeak() as heap:
                trainer.train()
            seconds = time.perf_counter() - start
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        result: dict = {"losses": losses, "steps": watch.steps, "seconds": seconds, "heap_peak": heap.peak}
        if offload_callback is not None:
            result["plans"] = len(offload_callback.engine.plans)
            result["lengths"] = sorted({key[0][0][1] for key in offload_callback.engine.plans})
            result["explain"] = offload.explain(offload_callback.engine)
        return result

    runs = {"none": run(None), "fixed": run({"budget_mb": budget_mb})}
    # The auto budget's device holds the most the fixed run ever had allocated (its engine's
    # resident bytes included), a reserve and the fixed budget: at that instant "auto" comes to at
    # least the fixed budget, and to more whenever the step holds less outside the engine.
    device = _Device(runs["fixed"]["heap_peak"] + int(2 * budget_mb * MB))
    runs["auto"] = run({"budget_mb": "auto", "reserve_mb": budget_mb, "memory": device})
    rows, summary = [], {}
    for name, result in runs.items():
        rss = [s["rss"] for s in result["steps"]][50:]
        spread = (max(rss) - min(rss)) / statistics.median(rss)
        record: dict = {
            "seconds": result["seconds"],
            "rest_rss_mb_from_step_50": [min(rss) / MB, max(rss) / MB],
            "rest_rss_spread": spread,
            "losses_equal": result["losses"] == runs["none"]["losses"],
        }
        if name != "none":
            stages = [s["stage"] for s in result["steps"]]
            over = [s for s in result["steps"] if s["over"] > 0]  # against the budget in force at each instant
            record.update(
                profiling_steps=sum(s is not None for s in stages),
                steps_over_budget=len(over),
                over_steps=[  # where to look first: which steps, at what budget, under which stage
                    {
                        "step": i,
                        "stage": s["stage"],
                        "over_mb": s["over"] / MB,
                        "budget_mb": None if s["budget"] is None else s["budget"] / MB,
                        "peak_mb": s["peak"] / MB,
                    }
                    for i, s in enumerate(result["steps"])
                    if s["over"] > 0
                ],
                worst_over_budget_mb=max((s["over"] for s in result["steps"]), default=0) / MB,
                plans_held=result["plans"],
                budget_mb_at_step_ends=_span(s["budget"] / MB for s in result["steps"] if s["budget"] is not None),
                explain=result["explain"],
            )
        summary[name] = record
        rows.append(
            [
                name,
                f"{result['seconds']:.0f}",
                record.get("profiling_steps", "-"),
                record.get("steps_over_budget", "-"),
                f"{min(rss) / MB:.0f}-{max(rss) / MB:.0f}",
                f"{100 * spread:.1f}",
                "yes" if record["losses_equal"] else "NO",
            ]
        )
    lengths = sorted({len(b) for b in _batches(data, batch)})
    text = table(
        ["run", "s", "profiling steps", "steps over budget", "RSS at rest MB (50+)", "spread %", "losses =="], rows
    )
    text += f"\n{args.steps} steps, {len(lengths)} distinct padded lengths ({lengths[0]}-{lengths[-1]})"
    text += f", fixed budget {budget_mb} MB"
    low, high = summary["auto"]["budget_mb_at_step_ends"]
    text += f", auto budget {low:.1f}-{high:.1f} MB at step ends (device of {device.capacity / MB:.0f} MB)"
    text += f"\n\nauto's last plan:\n{summary['auto']['explain']}"
    return emit("soak", text, {"budget_mb": budget_mb, "distinct_lengths": len(lengths), "runs": summary})


def _span(values: Iterable[float]) -> list[float]:
    ordered = sorted(values)
    return [round(ordered[0], 1), round(ordered[-1], 1)] if ordered else []


class _HeapPeak:
    """The most ``heap_in_use`` read while the block runs, sampled every ``interval_s`` by a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="heap-peak", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, heap_in_use())

    def __enter__(self) -> "_HeapPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _Device:
    """A device of ``capacity`` bytes for ``budget_mb="auto"`` on the CPU: what this process has
    allocated from malloc now (``heap_in_use``) is what the device has in use.

    The machine's available memory drifts by hundreds of MB over a long run on a shared host, far
    more than a budget of tens of MB (the budget it gave was 0 for the whole run), and the resident
    set counts freed heap not yet handed back (0 again), so neither can stand in for a device.
    Here the budget in force shrinks while a step holds memory outside the engine, as on a GPU.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def __call__(self) -> int:
        return max(0, self.capacity - heap_in_use())


def _batches(data: Ragged, batch: int) -> list:
    """The padded rows of each batch in order (the Trainer's sampler shuffles; this counts lengths)."""
    return [max(data.rows[i : i + batch], key=len) for i in range(0, len(data), batch)]


# ---------------------------------------------------------------------------------------- derive


def part_derive(args: argparse.Namespace) -> dict:
    results = {}
    for model_name, make, step, train_lengths, test_lengths in (
        ("minigpt", lambda: minigpt(layers=4), _gpt_step_fn(4), list(TRAIN_LENGTHS), _between(args.shapes)),
        ("llama", tiny_llama, _llama_step_fn(4), list(TRAIN_LENGTHS), _between(args.shapes)),
    ):
        results[model_name] = _derive_one(make, step, train_lengths, test_lengths, args.rounds)
    rows = []
    for model_name, r in results.items():
        rows.append(
            [
                model_name,
                len(r["shapes"]),
                f"{100 * r['bytes_worst']:.2f}",
                f"{100 * r['forward_median']:.1f} / {100 * r['forward_worst']:.1f}",
                f"{100 * r['step_median']:.1f} / {100 * r['step_worst']:.1f}",
                _within_cell(r["within"], "step"),
                f"{r['within']['lengths_model_step']}/{r['within']['lengths']}, "
                f"{r['within']['engines_model_step']}/{r['within']['engines']}",
                _within_cell(r["within"], "forward"),
            ]
        )
    text = table(
        [
            "model",
            "shapes",
            "bytes: worst miss %",
            "forward ms: median / worst %",
            "step: median / worst %",
            "step within 15 %: lengths, engines (floor)",
            "the same, cost model alone (unpaced)",
            "forward within 20 %: lengths, engines (floor)",
        ],
        rows,
    )
    return emit("derive", text, {"models": results})


def _within_cell(w: dict, what: str) -> str:
    engines = "engines" if what == "step" else "region_forwards"
    return f"{w['lengths_' + what]}/{w['lengths']}, {w['engines_' + what]}/{w[engines]} ({w['floor_' + what]})"


def _between(count: int) -> list[int]:
    rng = random.Random(7)
    picks = set()
    while len(picks) < count:
        seq = rng.randint(140, 500)
        if seq not in TRAIN_LENGTHS:
            picks.add(seq)
    return sorted(picks)


def _gpt_step_fn(batch: int) -> Callable:
    def step(model, seq, i, eng):
        return gpt_step(model, seq, batch, i, eng)

    return step


def _llama_step_fn(batch: int) -> Callable:
    def step(model, seq, i, eng):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(1, 512, (batch, seq), generator=g)
        model.zero_grad(set_to_none=True)
        if eng is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with eng:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    return step


def _derive_one(make: Callable, step: Callable, train_lengths: list[int], test_lengths: list[int], rounds: int) -> dict:
    """Each round trains a new engine on ``train_lengths``, then takes every test length in a
    rotated order, one after another as a loop would: its derived plan and steps timed under it;
    then a fresh engine profiles each length in the same order. (Not interleaved: the engine
    times each step up to its next one, and a step that also held another engine's profiling
    would be a disturbed one in what it paces its plans by.) Both sides of a length come from one
    round, a minute or so apart; each is the median over the rounds, so neither a slow minute of
    the machine nor one noisy profiling step decides."""
    model = make()
    budget_mb = 8
    samples: dict[int, list[dict]] = {seq: [] for seq in test_lengths}
    for r in range(rounds):
        eng = offload.engine(budget_mb, regions="auto", model=model)
        for i, seq in enumerate(train_lengths):
            step(model, seq, 1000 * r + i, eng)
        shift = r * len(test_lengths) // max(1, rounds)
        order = test_lengths[shift:] + test_lengths[:shift]
        derived = []
        for j, seq in enumerate(order):
            pace = 1.0 if eng.plan is None else eng.plan.pace  # what the steps before this length measured
            times = []
            for k in range(STEPS_UNDER_PLAN):
                start = time.perf_counter()
                step(model, seq, 1000 * r + 100 + STEPS_UNDER_PLAN * j + k, eng)
                times.append((time.perf_counter() - start) * 1e3)
            plan = eng.plan
            assert plan is not None
            derived.append((plan, pace, times))
        link = _link_line(eng)
        eng.close()
        for j, (seq, (plan, pace, times)) in enumerate(zip(order, derived, strict=True)):
            fresh = offload.engine(budget_mb, regions="auto", model=model)
            for k in range(3):  # "measure", "recompute", "offload"
                step(model, seq, 1000 * r + 500 + 3 * j + k, fresh)
            measured = next(p for p in fresh.profiled_steps if p.stage == "recompute").regions
            fresh.close()
            samples[seq].append(
                {
                    "origin": plan.origin,
                    "decisions": [d.value for d in plan.decisions],
                    "saved_derived": [d.saved_bytes for d in plan.regions],
                    "saved_measured": [m.saved_bytes for m in measured],
                    "forward_derived": [d.forward_ms for d in plan.regions],
                    "forward_measured": [m.forward_ms for m in measured],
                    "predicted_step_ms": plan.paced(pace).predicted_step_ms,
                    "model_step_ms": plan.paced(1.0).predicted_step_ms,
                    "pace": pace,
                    "measured_step_ms": median(times[1:]),  # the first pays the new shape's allocations
                    "link": link,
                }
            )
    shapes = [_derive_shape(seq, samples[seq]) for seq in test_lengths]
    return {
        "budget_mb": budget_mb,
        "trained_on": train_lengths,
        "rounds": rounds,
        "shapes": shapes,
        "derived": sum(all(o.startswith("derived") for o in s["origins"]) for s in shapes),
        "bytes_worst": max(s["bytes_miss"] for s in shapes),
        "forward_median": statistics.median(s["forward_miss_median"] for s in shapes),
        "forward_worst": max(s["forward_miss_worst"] for s in shapes),
        "step_median": statistics.median(s["step_miss"] for s in shapes),
        "step_worst": max(s["step_miss"] for s in shapes),
        "model_step_median": statistics.median(s["model_step_miss"] for s in shapes),
        "model_step_worst": max(s["model_step_miss"] for s in shapes),
        "within": _within(shapes),
    }


STEP_TARGET, FORWARD_TARGET = 0.15, 0.20
"""The issue's targets for a derived plan: its step within 15 % of the step measured, each
region's forward within 20 %."""


def _within(shapes: list[dict]) -> dict:
    """How many figures fall within their target: lengths (medians over the rounds), each round's
    engine alone, and the machine's own floor for the latter, each round's measured figure
    against the median of the other rounds' at that length (a predictor that knew every other
    round's measurement: what one step against one step spreads by here)."""

    def floor(values: list[float], i: int) -> float:
        return statistics.median(values[:i] + values[i + 1 :])

    counts = collections.Counter()
    for s in shapes:
        rounds = s["per_round"]
        steps = [r["measured_step_ms"] for r in rounds]
        counts["lengths_step"] += s["step_miss"] <= STEP_TARGET
        counts["lengths_model_step"] += s["model_step_miss"] <= STEP_TARGET
        counts["lengths_forward"] += s["forward_miss_worst"] <= FORWARD_TARGET
        forwards = [[q["forward_measured"][k] for q in rounds] for k in range(len(rounds[0]["forward_measured"]))]
        for i, r in enumerate(rounds):
            measured = r["measured_step_ms"]
            counts["engines"] += 1
            counts["engines_step"] += abs(r["predicted_step_ms"] - measured) <= STEP_TARGET * measured
            counts["engines_model_step"] += abs(r["model_step_ms"] - measured) <= STEP_TARGET * measured
            counts["floor_step"] += abs(floor(steps, i) - measured) <= STEP_TARGET * measured
            for k, m in enumerate(r["forward_measured"]):
                others = forwards[k]
                counts["region_forwards"] += 1
                counts["engines_forward"] += abs(r["forward_derived"][k] - m) <= FORWARD_TARGET * m
                counts["floor_forward"] += abs(floor(others, i) - m) <= FORWARD_TARGET * m
    return {"lengths": len(shapes), **counts}


def _link_line(eng: offload.Engine) -> str:
    """How the engine prices a transfer (``explain()``'s line): its link calibration, per round."""
    return next((line for line in offload.explain(eng).splitlines() if line.startswith("transfers priced at:")), "")


def _derive_shape(seq: int, rounds: list[dict]) -> dict:
    """One test length: per region, the median over the rounds of the derived and of the measured figures."""

    def per_region(key: str) -> list[float]:
        return [statistics.median(r[key][i] for r in rounds) for i in range(len(rounds[0][key]))]

    saved_d, saved_m = per_region("saved_derived"), per_region("saved_measured")
    forward_d, forward_m = per_region("forward_derived"), per_region("forward_measured")
    predicted = statistics.median(r["predicted_step_ms"] for r in rounds)
    model = statistics.median(r["model_step_ms"] for r in rounds)
    measured = statistics.median(r["measured_step_ms"] for r in rounds)
    forward_miss = [(d - m) / m for d, m in zip(forward_d, forward_m, strict=True)]
    return {
        "seq": seq,
        "origins": [r["origin"] for r in rounds],
        "decisions": [r["decisions"] for r in rounds],
        "bytes_miss": max(abs(d - m) / m for d, m in zip(saved_d, saved_m, strict=True)),
        "forward_ms_derived": forward_d,
        "forward_ms_measured": forward_m,
        "forward_signed_miss": forward_miss,
        "forward_miss_median": statistics.median(abs(x) for x in forward_miss),
        "forward_miss_worst": max(abs(x) for x in forward_miss),
        "predicted_step_ms": predicted,
        "measured_step_ms": measured,
        "step_signed_miss": (predicted - measured) / measured,
        "step_miss": abs(predicted - measured) / measured,
        "model_step_ms": model,
        "model_step_miss": abs(model - measured) / measured,
        "per_round": rounds,
    }


# ---------------------------------------------------------------------------------------- pair


def part_pair(args: argparse.Namespace) -> dict:
    policies = ("auto", "offload", "recompute", "selective")
    budget_mb = 12
    base = minigpt(layers=4)
    models = {p: copy.deepcopy(base) for p in policies}
    engines = {p: offload.engine(budget_mb, policy=p, regions="auto", model=models[p]) for p in policies}
    rng = random.Random(3)
    warm = [rng.randint(96, 384) for _ in range(12)]
    for p in policies:
        for i, seq in enumerate(warm):
            gpt_step(models[p], seq, 4, i, engines[p])
    step_ms: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(args.rounds):
        seqs = [rng.randint(96, 384) for _ in range(args.steps_per_round)]
        spent = dict.fromkeys(policies, 0.0)
        # Step by step: every policy takes each length in turn (the order rotated), so a policy
        # is paired with the others within a second or two, not the ~15 s a round takes: this
        # VM's speed drifts 10-20 % from minute to minute.
        for i, seq in enumerate(seqs):
            k = (r * len(seqs) + i) % len(policies)
            for p in policies[k:] + policies[:k]:
                start = time.perf_counter()
                gpt_step(models[p], seq, 4, 100 + i, engines[p])
                spent[p] += time.perf_counter() - start
        for p in policies:
            step_ms[p].append(spent[p] * 1e3 / len(seqs))
    profiled = {p: sum(s is not None for s in engines[p].recent_stages) for p in policies}
    auto_plans = collections.Counter(
        " ".join(d.value for d in plan.decisions) for plan in engines["auto"].plans.values()
    )
    auto_link = _link_line(engines["auto"])
    for eng in engines.values():
        eng.close()
    fixed = [p for p in policies if p != "auto"]
    best = min(fixed, key=lambda p: median(step_ms[p]) or float("inf"))
    ratios = [a / b for a, b in zip(step_ms["auto"], step_ms[best], strict=True)]
    rows = [[p, f"{median(step_ms[p]):.1f}", f"{min(step_ms[p]):.1f}", profiled[p]] for p in policies]
    text = table(["policy", "median step ms", "best round ms", "profiling steps"], rows)
    text += f"\nauto / best fixed ({best}): {statistics.median(ratios):.3f} (median of {len(ratios)} paired rounds)"
    return emit(
        "pair",
        text,
        {
            "budget_mb": budget_mb,
            "interleaved": "step by step",
            "step_ms": step_ms,
            "best_fixed": best,
            "auto_over_best": statistics.median(ratios),
            "auto_plans": dict(auto_plans.most_common()),
            "auto_link": auto_link,
        },
    )


# ---------------------------------------------------------------------------------------- fixed


def _peak_rss() -> int:
    """The resident set's high-water mark since the last ``_reset_peak`` (VmHWM)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident set now (Linux >= 4.0)


def _fixed_child(policy: str, budget_mb: float, steps: int) -> dict:
    """One process: ``steps`` steps (profiling included), then 3 more, each span's RSS peak over rest."""
    model = minigpt()
    eng = None if policy == "none" else offload.engine(budget_mb, policy=policy, regions=model.blocks, model=model)
    rest = rest_rss()
    _reset_peak()
    for i in range(steps):
        gpt_step(model, 256, 4, i, eng)
    first = _peak_rss() - rest
    rest_after = rest_rss()
    _reset_peak()
    for i in range(3):
        gpt_step(model, 256, 4, steps + i, eng)
    steady = _peak_rss() - rest_after
    stages = [] if eng is None else list(eng.recent_stages)
    plan = None if eng is None else eng.plan
    return {
        "policy": policy,
        "peak_first_mb": first / MB,
        "peak_steady_mb": steady / MB,
        "stages": stages,
        "decisions": [] if plan is None else [d.value for d in plan.decisions],
        "predicted_peak_mb": None if plan is None else plan.predicted_peak_bytes / MB,
        "link": "" if eng is None else _link_line(eng),
    }


def part_fixed(args: argparse.Namespace) -> dict:
    """At one fixed shape (MiniGPT 8 x 256, batch 4, sequence 256), budget 40 MB: each policy in
    its own process (a high-water mark never comes down), rounds interleaved."""
    budget_mb = 40.0
    runs: dict[str, list[dict]] = {"none": [], "offload": [], "auto": []}
    for _ in range(args.rounds):
        for policy in runs:
            cmd = [sys.executable, __file__, "fixed-child", f"--policy={policy}", f"--budget-mb={budget_mb}"]
            if args.threads:
                cmd.append(f"--threads={args.threads}")
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[policy].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows, summary = [], {}
    for policy, results in runs.items():
        first = median([r["peak_first_mb"] for r in results])
        steady = median([r["peak_steady_mb"] for r in results])
        summary[policy] = {"peak_first_mb": first, "peak_steady_mb": steady}
        rows.append([policy, f"+{first:.1f}", f"+{steady:.1f}", " ".join(s or "-" for s in results[0]["stages"])])
    ratio_first = summary["auto"]["peak_first_mb"] / summary["offload"]["peak_first_mb"]
    ratio_steady = summary["auto"]["peak_steady_mb"] / summary["offload"]["peak_steady_mb"]
    text = table(["policy", "peak RSS over rest, MB: first 8 steps", "next 3 steps", "stages"], rows)
    text += f"\nauto / offload peak growth at {budget_mb:.0f} MB: {ratio_first:.3f} over the first 8 steps (profiling "
    text += f"included), {ratio_steady:.3f} under the plan (medians of {args.rounds} interleaved rounds)"
    payload = {"budget_mb": budget_mb, "runs": runs, "summary": summary}
    return emit("fixed", text, {**payload, "auto_over_offload_first": ratio_first, "auto_over_offload": ratio_steady})


# ---------------------------------------------------------------------------------------- curve

CURVE_LENGTHS = (128, 164, 169, 177, 188, 217, 256, 305, 327, 342, 384, 399, 414, 438, 473, 512)
"""curve: derive's lengths and the ones its engines were trained on."""


def part_curve(args: argparse.Namespace) -> dict:
    """One block's forward alone (no engine) at each length, the lengths interleaved and their order
    reversed every round: is the time a region's fit has to follow smooth in the length?"""
    llama = tiny_llama()
    rotary, layer = llama.model.rotary_emb, llama.model.layers[0]

    def llama_block(x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1])[None]
        return layer(x, position_embeddings=rotary(x, positions), attention_mask=None, position_ids=positions)

    blocks = {"minigpt": minigpt(layers=1).blocks[0], "llama": llama_block}
    curves, rows = {}, []
    for name, block in blocks.items():
        times: dict[int, list[float]] = {seq: [] for seq in CURVE_LENGTHS}
        for r in range(1 + args.rounds):
            for seq in CURVE_LENGTHS if r % 2 == 0 else CURVE_LENGTHS[::-1]:
                x = torch.randn(4, seq, 256, requires_grad=True)
                start = time.perf_counter()
                out = block(x)
                ms = (time.perf_counter() - start) * 1e3
                (out[0] if isinstance(out, tuple) else out).sum().backward()
                if r > 0:  # the first round allocates every length
                    times[seq].append(ms)
        per_token = {seq: 1e3 * median(t) / seq for seq, t in times.items()}
        flops = {seq: _forward_flops(block, seq) for seq in CURVE_LENGTHS}
        fits = _fit_misses({seq: median(t) for seq, t in times.items()}, flops)
        curves[name] = {
            str(seq): {"median_ms": median(t), "us_per_token": per_token[seq], "flops": flops[seq]}
            for seq, t in times.items()
        }
        curves[name]["fits"] = fits
        low, high = min(per_token.values()), max(per_token.values())
        rows.append(
            [
                name,
                f"{low:.1f} .. {high:.1f}",
                f"{flops[CURVE_LENGTHS[-1]] / CURVE_LENGTHS[-1] / (flops[CURVE_LENGTHS[0]] / CURVE_LENGTHS[0]):.3f}",
                f"{per_token[CURVE_LENGTHS[-1]] / per_token[CURVE_LENGTHS[0]]:.3f}",
                _misses_cell(fits["shape_terms"]),
                _misses_cell(fits["flops"]),
                " ".join(f"{per_token[seq]:.0f}" for seq in CURVE_LENGTHS),
            ]
        )
    text = table(
        [
            "block",
            "us per token",
            "flops/token last÷first",
            "time/token last÷first",
            f"fit on {FIT_LENGTHS} by n, n·s: worst, at {FAR_LENGTHS} (%)",
            "by the FLOPs count (%)",
            "per length " + " ".join(str(s) for s in CURVE_LENGTHS),
        ],
        rows,
    )
    return emit("curve", text, {"lengths": list(CURVE_LENGTHS), "rounds": args.rounds, "curves": curves})


FIT_LENGTHS = (128, 256, 512)
"""curve: the lengths a fit is given, as a derive engine's trial steps measure 131, 250 and 509."""
FAR_LENGTHS = (399, 414, 438, 473)
"""curve: the lengths where a fit without the attention term was seen low (derive, 2026-12-03)."""


class _CountFlops(TorchDispatchMode):
    """FLOPs of every op run under it, looked up as the engine's trial re-run does (``flop_formula``:
    torch's formulas, and the CPU's fused attention as flash attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_formula(func)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def _forward_flops(block: Callable, seq: int) -> int:
    """FLOPs of one forward of ``block`` at ``seq``, as the engine counts them."""
    with torch.no_grad(), _CountFlops() as counter:
        block(torch.randn(4, seq, 256))
    return counter.flops


def _fit_misses(ms: dict[int, float], flops: dict[int, int]) -> dict:
    """A region's forward-time fit from its times at ``FIT_LENGTHS`` (each the median of the
    rounds), as the engine makes it: on the shape's terms (n, n·s), and on the FLOPs counted at
    the same lengths. Signed misses against the times at every other length."""
    plain = FieldFit(TIME_TOLERANCE, TIME_BASES, cross_validate=True)
    counts = FieldFit(BYTE_TOLERANCE, BYTE_BASES)
    counted = FieldFit(TIME_TOLERANCE, TIME_BASES, cross_validate=True, flops=counts)
    shapes = {seq: Shape.of((4, seq, 256)) for seq in ms}
    for seq in FIT_LENGTHS:
        plain.add(shapes[seq], ms[seq])
        counts.add(shapes[seq], flops[seq])
        counted.add(shapes[seq], ms[seq])
    out = {}
    for name, fit in (("shape_terms", plain), ("flops", counted)):
        misses = {seq: fit.at(shapes[seq]) / ms[seq] - 1 for seq in ms if seq not in FIT_LENGTHS}
        out[name] = {"basis": "+".join(fit.model().basis), "misses": {str(k): v for k, v in misses.items()}}
    return out


def _misses_cell(fit: dict) -> str:
    misses = {int(k): v for k, v in fit["misses"].items()}
    worst = max(misses.values(), key=abs)
    far = " ".join(f"{100 * misses[seq]:+.0f}" for seq in FAR_LENGTHS)
    return f"[{fit['basis']}] {100 * worst:+.1f}; {far}"


PARTS = {
    "leak": part_leak,
    "soak": part_soak,
    "derive": part_derive,
    "pair": part_pair,
    "fixed": part_fixed,
    "curve": part_curve,
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=[*PARTS, "all", "fixed-child"])
    parser.add_argument("--policy", default="auto", help=argparse.SUPPRESS)  # fixed-child
    parser.add_argument("--budget-mb", type=float, default=40.0, help=argparse.SUPPRESS)  # fixed-child
    parser.add_argument("--steps-per-shape", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500, help="soak: optimizer steps")
    parser.add_argument("--shapes", type=int, default=12, help="derive: lengths never measured")
    parser.add_argument("--rounds", type=int, default=5, help="pair, curve, derive: interleaved rounds")
    parser.add_argument("--steps-per-round", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "fixed-child":
        print(json.dumps(_fixed_child(args.policy, args.budget_mb, steps=8)))
        return 0
    for name in PARTS if args.part == "all" else [args.part]:
        PARTS[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
