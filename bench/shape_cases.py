"""The two loops that first showed the planned engine failing on changing shapes, as a user wrote them.

1. **Memory per shape**: MiniGPT (8 blocks, width 256, batch 4) under
   ``offload.engine(budget_mb=20, policy="auto", regions=model.blocks)``, four steps at each of the
   lengths 128, 160, 192, 224, 256, then 128 and 160 again; the process's RSS at rest after each
   length (garbage collected, the heap trimmed), over its RSS before the first step.
2. **Dynamic padding**: Hugging Face's ``Trainer`` on a tiny Llama (4 layers, width 256), 64 rows of
   lengths 64-512 padded per batch of 2 (32 steps), ``OffloadCallback(budget_mb=8,
   regions=model.model.layers)``: how many steps were profiling steps and how many ran under a plan,
   and the padded length of each step.

Only what both old and new engines have is used (``Engine.recent_stages``, a debug view, tells
a profiling step from one under a plan), so the same script measures any
version of the package: ``PYTHONPATH=<a checkout of an old commit> python bench/shape_cases.py``
gives the "before", the working tree the "after". Prints a table and a last-line JSON (written to
``$OFFLOAD_BENCH_OUT/shape-cases.json``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import offload  # noqa: E402
from hf_models import cpu_trainer_args, tiny_llama  # noqa: E402
from offload.bench.measure import environment  # noqa: E402
from offload.models.gpt import GPTConfig, MiniGPT  # noqa: E402
from process_memory import rest_rss  # noqa: E402

MB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"


def memory_per_shape() -> tuple[float, list[dict]]:
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, seq_len=256, dropout=0.0))
    eng = offload.engine(budget_mb=20, policy="auto", regions=model.blocks)
    start = rest_rss()
    rows, step = [], 0
    for seq in (128, 160, 192, 224, 256, 128, 160):
        for _ in range(4):
            idx = torch.randint(0, 256, (4, seq + 1), generator=torch.Generator().manual_seed(step))
            model.zero_grad(set_to_none=True)
            with eng:
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            del loss
            step += 1
        rows.append({"seq": seq, "rss_over_start_mb": (rest_rss() - start) / MB})
    eng.close()
    return start / MB, rows


def _padding():
    """This tree's ``offload/bench/padding.py``, read from its file: an older package on the path
    may not have it."""
    path = Path(__file__).resolve().parents[1] / "offload" / "bench" / "padding.py"
    spec = importlib.util.spec_from_file_location("_shape_cases_padding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Ragged, module.pad_to_longest


def dynamic_padding() -> dict:
    import transformers

    from offload.integrations.hf import OffloadCallback

    Ragged, pad_to_longest = _padding()

    class Stages(transformers.TrainerCallback):
        def __init__(self, offload_callback: OffloadCallback) -> None:
            self.offload_callback = offload_callback
            self.profiling: list[bool] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.profiling.append(self.offload_callback.engine.recent_stages[-1] is not None)

    model = tiny_llama()
    data = Ragged(64, 64, 512, vocab=512)
    callback = OffloadCallback(budget_mb=8, regions=model.model.layers)
    stages = Stages(callback)
    padded: list[int] = []  # each batch's padded length, as the collator made it

    def collate(features: list) -> dict:
        batch = pad_to_longest(features)
        padded.append(batch["input_ids"].shape[1])
        return batch

    with tempfile.TemporaryDirectory() as out:
        args = cpu_trainer_args(out, 2, learning_rate=1e-3, logging_steps=500)
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=collate,
            callbacks=[callback, stages],
        )
        trainer.train()
    return {
        "steps": len(stages.profiling),
        "profiling_steps": sum(stages.profiling),
        "steps_under_a_plan": len(stages.profiling) - sum(stages.profiling),
        "padded_lengths": padded,
        "distinct_padded_lengths": len(set(padded)),
    }


def main() -> None:
    torch.set_num_threads(1)
    package = Path(offload.__file__).resolve().parent
    env = environment(torch.device("cpu"))  # names the commit of the package's checkout
    commit = env["git_commit"] or "unknown"
    start_mb, shapes = memory_per_shape()
    padding = dynamic_padding()
    print(f"offload from {package} (commit {commit}), torch {torch.__version__}")
    print("seq   RSS at rest, MB over start")
    for row in shapes:
        print(f"{row['seq']:<5} {row['rss_over_start_mb']:+.1f}")
    after_first = [r["rss_over_start_mb"] for r in shapes[1:]]
    spread = (max(after_first) - min(after_first)) / (start_mb + min(after_first))
    print(
        f"RSS at rest after the first shape: {min(after_first):+.1f} to {max(after_first):+.1f} MB over a start of "
        f"{start_mb:.0f} MB, a spread of {100 * spread:.1f} % of RSS"
    )
    print(
        f"dynamic padding: {padding['profiling_steps']} of {padding['steps']} steps profiling, "
        f"{padding['steps_under_a_plan']} under a plan ({padding['distinct_padded_lengths']} distinct padded lengths)"
    )
    payload = {
        "package_commit": commit,
        "environment": env,
        "start_rss_mb": start_mb,
        "memory_per_shape": shapes,
        "rest_rss_spread_after_first_shape": spread,
        "dynamic_padding": padding,
    }
    write_result(payload)
    print(json.dumps(payload))


def write_result(payload: dict) -> Path:
    """``payload`` to ``$OFFLOAD_BENCH_OUT/shape-cases.json`` (default ``out/bench``); a path in
    this tree's committed ``bench/results/`` is refused (an older package's ``check_out`` would
    guard the wrong tree, and the oldest have none)."""
    out = Path(os.environ.get("OFFLOAD_BENCH_OUT") or "out/bench").resolve()
    if out == RESULTS or RESULTS in out.parents:
        raise ValueError(f"{str(out)!r} is in the committed results ({RESULTS}); write under out/bench/ and copy it")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "shape-cases.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


if __name__ == "__main__":
    main()
