"""Saves shared by a tensor-parallel group: bytes kept and moved per rank, and the gathers' time.

    python bench/sharded.py [--worlds 2,4] [--width 256] [--layers 4] [--steps 6]

Runs ``tests/shard_worker.py`` under torchrun on gloo (CPU ranks) for each world size: a
Megatron-style tensor-parallel stack, sequence lengths changing every step, budgets None / 0 / a
third of what it saves, the saves declared by the block (``offload.sharded``) or the inputs of
blocks run as recompute (``shared_inputs=``), each beside the same engine with nothing shared.
Per configuration (rank 0's figures; every rank's gradients checked with ``torch.equal``;
``verify`` off, as a run after its first would have it): the
shared saves' bytes kept (whole against sliced), bytes moved off the device, the gathers' wait
per step and the step time (median of the steps after the first). A table, then one JSON line;
the JSON also goes to ``$OFFLOAD_BENCH_OUT/sharded.json`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from offload.bench.measure import environment, table, write_json  # noqa: E402

WORKER = ROOT / "tests" / "shard_worker.py"
MB = 1 << 20


def launch(world: int, args: argparse.Namespace) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"sharded{world}-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(WORKER)]
    cmd += [str(out), f"--width={args.width}", f"--layers={args.layers}", f"--steps={args.steps}", "--no-verify"]
    cmd += [f"--min-offload-bytes={args.min_offload_bytes}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"torchrun with {world} ranks failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def rows_of(world: int, ranks: list[dict]) -> list[dict]:
    rank0 = ranks[0]["configs"]
    rows = []
    for name in rank0:
        budget, mode, kind = name.split("/")
        if kind != "shared":
            continue
        whole, shared = rank0[f"{budget}/{mode}/whole"], rank0[name]
        ws, ss = whole["stats"], shared["stats"]
        rows.append(
            {
                "world": world,
                "budget": budget,
                "mode": mode,
                "exact": all(r["configs"][key]["exact"] for r in ranks for key in (name, f"{budget}/{mode}/whole")),
                "shared_mb": ss["shared_bytes"] / MB,
                "kept_mb": ss["shared_kept_bytes"] / MB,
                "moved_whole_mb": ws["offloaded_bytes"] / MB,
                "moved_shared_mb": ss["offloaded_bytes"] / MB,
                "gather_ms_per_step": ss["gather_wait_ms"] / len(shared["step_ms"]),
                "step_whole_ms": statistics.median(whole["step_ms"][1:]),
                "step_shared_ms": statistics.median(shared["step_ms"][1:]),
            }
        )
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--min-offload-bytes", type=int, default=64 * 1024, help="the engines' (default: offload's)")
    args = parser.parse_args(argv)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        rows += rows_of(world, launch(world, args))
    text = table(
        [
            "ranks",
            "budget",
            "declared by",
            "exact",
            "shared MB",
            "kept MB (ratio)",
            "moved MB whole / shared (ratio)",
            "gather ms/step",
            "step ms whole / shared (ratio)",
        ],
        [
            [
                r["world"],
                r["budget"],
                "block" if r["mode"] == "declared" else "recompute inputs",
                "yes" if r["exact"] else "NO",
                f"{r['shared_mb']:.2f}",
                f"{r['kept_mb']:.2f} ({r['kept_mb'] / r['shared_mb']:.3f})",
                f"{r['moved_whole_mb']:.2f} / {r['moved_shared_mb']:.2f}"
                + (f" ({r['moved_shared_mb'] / r['moved_whole_mb']:.3f})" if r["moved_whole_mb"] else ""),
                f"{r['gather_ms_per_step']:.1f}",
                f"{r['step_whole_ms']:.0f} / {r['step_shared_ms']:.0f}"
                f" ({r['step_shared_ms'] / r['step_whole_ms']:.2f})",
            ]
            for r in rows
        ],
        markdown=True,
    )
    print(text)
    payload = {
        "bench": "sharded",
        "settings": vars(args),
        "rows": rows,
        "environment": environment(torch.device("cpu")),
    }
    out = Path(os.environ.get("OFFLOAD_BENCH_OUT", "out/bench"))
    write_json(out / "sharded.json", payload)
    print(json.dumps(payload))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
