"""Per-layer cost of moving saved activations versus recomputing them: the plain-python runner.

    python bench/layers.py [--device cpu|cuda] [--sizes cpu|cuda|tiny] [--only LAYER,...] [--json-out PATH]

The same measurements as the pytest-benchmark suite (``pytest bench``, see ``test_layers.py``
for what each figure means), for machines without pytest-benchmark: each layer's three variants
(keep, offload, recompute) are timed interleaved after a warm-up, and the medians compared.
Prints the table, writes the JSON (default ``bench/results/layers-<device>.json``, or
``$OFFLOAD_BENCH_OUT``), and prints the same JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import common
import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--sizes", default=None, help=f"size preset: {', '.join(common.SIZE_PRESETS)}")
    parser.add_argument("--only", default=None, help="comma-separated layer names to run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json-out", default=None, help="where to write the JSON (default: results/layers-<device>.json)")
    args = parser.parse_args(argv)
    if args.sizes:
        os.environ[common.SIZES_ENV] = args.sizes
    device = common.parse_device(args.device)
    common.set_threads(args.threads)
    warmup, rounds = common.layer_rounds(device)
    only = set(args.only.split(",")) if args.only else None

    rows = []
    for case in common.cases(device):
        if only and case.layer not in only:
            continue
        bench = common.LayerBench(case, device)
        try:
            fns = {kind: bench.step(kind) for kind in common.LayerBench.KINDS}  # keep runs just before offload
            times = common.interleaved_ms(fns, rounds=rounds, warmup=warmup, device=device)
            facts = bench.facts()
        finally:
            bench.close()
        medians = {kind: common.median(ms) for kind, ms in times.items()}
        transfer = common.paired_difference_ms(times["offload"], times["keep"])
        rows.append(common.layer_row(case, device, medians, transfer, facts))
        print(f"  {case.id}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()), file=sys.stderr)
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()

    payload = common.layers_payload(rows, device, runner="bench/layers.py")
    print(f"layers on {common.describe_machine(payload['env'])}")
    print(common.layers_table(rows))
    print(common.describe_fit(payload["transfer_fit"]))
    out = args.json_out or common.layers_out_path(device)
    common.write_json(out, payload)
    print(f"wrote {out}")
    print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
