"""The plan against the step it plans: predicted and measured, with what is saved outside the regions.

    python bench/whole_step.py gpt2    [--steps 8]     the Hugging Face GPT-2 case of issue #23
    python bench/whole_step.py builds  [--builds 10] [--neighbour-workers 2]
                                                        one setup built ten times beside a noisy
                                                        neighbour: do the plans hold still?

gpt2    GPT-2 (4 layers, width 256, vocabulary 50,257, random init), batch 8 x 256 tokens, under
        the real ``Trainer`` with ``OffloadCallback(budget_mb=32, regions=model.transformer.h)``
        and without it, interleaved run by run. Per run: the median step time over the steps after
        profiling, the bytes moved per step, and the plan's predicted overhead and peak; the
        measured overhead is engine step / plain step - 1. Run it against any checkout
        (``PYTHONPATH=that/tree``) to compare before and after a change: it reads only the public
        API, and the plan's rows outside the regions where the plan has them.
builds  MiniGPT 4 x 256 (the demo's shape), policy "auto" at a quarter of its saved bytes, each
        build a fresh process: the decisions, the profiling stages, the link readings of its
        "offload" trials, and the transfer cost the calibrated plan charges per region as GB/s
        (out and back over the region's bytes). ``--neighbour-workers N`` runs
        ``noisy_neighbour.py --workers N --seed S`` beside the builds (0: none).

Each part prints a table and ends with one JSON line; the JSON goes to
``$OFFLOAD_BENCH_OUT/whole-step-<part>.json`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench's shared modules, also when loaded by path

import torch  # noqa: E402

import offload  # noqa: E402
from hf_models import cpu_trainer_args  # noqa: E402
from offload.bench.measure import check_out, environment, out_dir, table, write_json  # noqa: E402

MB = 1 << 20


def emit(part: str, text: str, payload: dict) -> dict:
    payload = {"part": part, "env": environment(torch.device("cpu")), **payload}
    print(text)
    print(f"(written to {write_json(check_out(out_dir() / f'whole-step-{part}.json'), payload)})")
    print(json.dumps(payload, default=str))
    return payload


# ---------------------------------------------------------------------------------------- gpt2


def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, n_positions=256, vocab_size=50257)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, rows: int) -> None:
        self.ids = torch.randint(0, 50257, (rows, 256), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(steps: int, with_engine: bool) -> dict:
    import transformers

    from offload.integrations.hf import OffloadCallback

    model = _gpt2()
    times: list[float] = []
    moved: list[int] = []
    callback = OffloadCallback(budget_mb=32, regions=model.transformer.h) if with_engine else None

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            self.moved = callback.engine.stats.offloaded_bytes if callback else 0

        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.perf_counter() - self.start) * 1e3)
            if callback:
                moved.append(callback.engine.stats.offloaded_bytes - self.moved)

    with tempfile.TemporaryDirectory() as out:
        args = cpu_trainer_args(out, 8, learning_rate=1e-4, logging_steps=1000)
        callbacks = [c for c in (callback, Clock()) if c is not None]
        transformers.Trainer(model=model, args=args, train_dataset=_Tokens(8 * steps), callbacks=callbacks).train()
    record: dict = {"step_ms": times}
    if callback is not None:
        eng = callback.engine
        stages = list(eng.recent_stages)
        planned = [i for i, s in enumerate(stages) if s is None]
        plan = eng.plan
        assert plan is not None
        outside = [
            {"name": r.name, "mb": r.saved_bytes / MB, "decision": r.decision.value}
            for r in getattr(plan, "outside", ())
        ]
        record.update(
            stages=stages,
            planned_steps=planned,
            moved_mb_per_step=statistics.median(moved[i] for i in planned) / MB if planned else None,
            predicted_overhead=plan.predicted_overhead_ms / plan.baseline_step_ms,
            predicted_peak_mb=plan.predicted_peak_bytes / MB,
            decisions=[d.value for d in plan.decisions],
            outside=outside,
            explain=offload.explain(eng),
        )
    return record


def part_gpt2(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {"none": [], "engine": []}
    for _ in range(args.repeats):
        for name in ("none", "engine"):
            runs[name].append(_train(args.steps, name == "engine"))
    ratios = []
    for plain, eng in zip(runs["none"], runs["engine"], strict=True):
        planned = eng["planned_steps"]
        eng_ms = statistics.median(eng["step_ms"][i] for i in planned)
        plain_ms = statistics.median(plain["step_ms"][i] for i in planned)
        ratios.append(eng_ms / plain_ms)
    last = runs["engine"][-1]
    rows = [
        [
            f"{100 * last['predicted_overhead']:.1f}",
            f"{100 * (statistics.median(ratios) - 1):.1f}",
            f"{last['moved_mb_per_step']:.0f}",
            f"{last['predicted_peak_mb']:.1f}",
            " ".join(last["decisions"]),
            "; ".join(f"{o['name']} {o['mb']:.0f} MB {o['decision']}" for o in last["outside"]) or "-",
        ]
    ]
    text = table(
        ["predicted overhead %", "measured overhead %", "moved MB/step", "predicted peak MB", "decisions", "outside"],
        rows,
    )
    text += f"\n(measured: median over {len(ratios)} interleaved runs of the per-run median planned step)\n\n"
    text += last["explain"]
    return emit("gpt2", text, {"runs": runs, "engine_over_none": ratios, "tree": offload.__file__})


# ---------------------------------------------------------------------------------------- builds


_BUILD = """
import json, torch, offload
from offload.models import GPTConfig, MiniGPT
torch.manual_seed(0)
model = MiniGPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=256, dropout=0.1, attention="math"))
counting = offload.engine(None, model=model)
x = torch.randint(0, 256, (4, 257), generator=torch.Generator().manual_seed(1))
with counting:
    _, loss = model(x[:, :-1], x[:, 1:])
budget_mb = 0.25 * counting.stats.saved_bytes / 2**20
del loss
counting.close()
eng = offload.engine(budget_mb, regions=model.blocks, model=model)
for step in range(STEPS):
    model.zero_grad(set_to_none=True)
    with eng:
        _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
plan = eng.plan
assert eng.recent_stages[-1] is None, list(eng.recent_stages)
transfers = [line for line in offload.explain(eng).splitlines() if line.startswith("transfers priced at")]
print(json.dumps({
    "stages": list(eng.recent_stages),
    "decisions": [d.value for d in plan.decisions],
    "transfers": transfers[0] if transfers else None,
    "transfer_gb_per_s": [2 * r.saved_bytes / (r.transfer_ms * 1e6) for r in plan.regions],
    "budget_mb": budget_mb,
}))
"""


BUILD_STEPS = 10
"""Steps per build: profiling at most (a "measure" step, then up to ``MAX_TRIAL_ROUNDS`` rounds of
a "recompute" and an "offload" trial) and plans after."""


def part_builds(args: argparse.Namespace) -> dict:
    builds = []
    neighbour = None
    if args.neighbour_workers:
        script = Path(__file__).resolve().parent / "noisy_neighbour.py"
        command = [sys.executable, str(script), "--workers", str(args.neighbour_workers)]
        neighbour = subprocess.Popen(command + ["--seed", str(args.neighbour_seed)])
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # killed: the finally below stops the neighbour
    started = time.time()
    try:
        for _ in range(args.builds):
            env = dict(os.environ, PYTHONPATH=str(Path(offload.__file__).resolve().parents[1]))
            code = f"STEPS = {BUILD_STEPS}\n" + _BUILD
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
            builds.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        if neighbour is not None:
            neighbour.terminate()
            neighbour.wait()
    rates = [statistics.median(b["transfer_gb_per_s"]) for b in builds]
    rows = [
        [
            i,
            " ".join(b["decisions"]),
            f"{statistics.median(b['transfer_gb_per_s']):.3f}",
            " ".join(map(str, b["stages"])),
        ]
        for i, b in enumerate(builds)
    ]
    distinct = len({tuple(b["decisions"]) for b in builds})
    text = table(["build", "decisions", "calibrated GB/s (median region)", "stages"], rows)
    text += f"\n{distinct} distinct plan(s) in {len(builds)} builds"
    text += f"; calibrated GB/s from {min(rates):.3f} to {max(rates):.3f}"
    text += f"\n{args.builds} builds in {time.time() - started:.0f} s"
    if args.neighbour_workers:
        text += f", beside noisy_neighbour.py --workers {args.neighbour_workers} --seed {args.neighbour_seed}"
    neighbour_note = {"workers": args.neighbour_workers, "seed": args.neighbour_seed}
    payload = {"builds": builds, "distinct_plans": distinct, "gb_per_s": rates, "neighbour": neighbour_note}
    return emit("builds", text, payload)


PARTS = {"gpt2": part_gpt2, "builds": part_builds}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=list(PARTS))
    parser.add_argument("--steps", type=int, default=8, help="gpt2: optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="gpt2: interleaved runs of each")
    parser.add_argument("--builds", type=int, default=10)
    parser.add_argument("--neighbour-workers", type=int, default=0, help="builds: noisy neighbours beside them")
    parser.add_argument("--neighbour-seed", type=int, default=1)
    args = parser.parse_args(argv)
    PARTS[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
