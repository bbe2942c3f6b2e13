"""offload.predict against published runs of another system it was never fitted to: torchtitan on 64 A100s.

    python bench/predict_heldout.py [--out bench/results]

The runs (``RUNS``): torchtitan's ``docs/performance.md`` (``SOURCE``, at a fixed commit) publishes
tokens/s per GPU ("WPS") of Llama 2 and Llama 3 models trained with FSDP2 on 64 A100 80GB GPUs, local
batch 1 or 2, with no activation checkpointing, "full", "selective layer" and "selective op". They
are held out: nothing in ``offload/_predict`` was fitted on them (the A100's compute efficiency and
exposed fraction were fitted on MosaicML's MPT runs, ``predict-published.md``). Each run's step
of one micro-batch is batch x sequence / WPS.

Each model is predicted as a Hugging Face ``LlamaForCausalLM`` of its published shape (``SHAPES``:
width, layers, heads, key/value heads, MLP width, vocabulary, sequence: Llama 3 at 8192 and Llama 2
at 4096, as the source says), bf16, SDPA's fused attention, on the named ``a100-80gb-sxm`` as it is,
sharded over 64 GPUs (``sharded_over=64``: 8 nodes, collectives at the slower of NVLink and the
network between nodes, the DGX A100's 25 GB/s a GPU: the runs' network is not published),
gradients reduced in fp32 (FSDP2's ``reduce_dtype`` in torchtitan's default
``mixed_precision_reduce = "float32"``). The activation checkpointing maps onto the table's rows:

    no                 "none"
    full               "checkpoint" (every block under torch.utils.checkpoint)
    selective layer    "checkpoint" with ``regions="every:2:1"``: torchtitan's ``selective_ac_option``
                       "2" checkpoints every second block (an assumption: the option is not published
                       beside the figures; "2" is the one its configs name)
    selective op       "selective" with ``selective_rule="torchtitan-op"`` (mm and attention saved,
                       every second mm re-run)

Memory: that source publishes none; torchtitan's H100 benchmark (``H100_RUNS``) publishes two, with
two more step times on a 96 GB, 500 W H100 over 8 and 128 GPUs. Prints a table, writes
``predict-heldout.md`` and ``.json`` under ``--out``, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import offload` from a checkout

import torch  # noqa: E402

from offload._predict.predict import predict  # noqa: E402

SOURCE = "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md"
GPUS = 64
MACHINE = "a100-80gb-sxm"
TOLERANCE = 0.15
SHAPES = {  # width, layers, heads, kv heads, MLP width, vocabulary, sequence (Meta's published Llama configs)
    "Llama 3 8B": (4096, 32, 32, 8, 14336, 128256, 8192),
    "Llama 3 70B": (8192, 80, 64, 8, 28672, 128256, 8192),
    "Llama 2 13B": (5120, 40, 40, 40, 13824, 32000, 4096),
    "Llama 2 70B": (8192, 80, 64, 8, 28672, 32000, 4096),
}
RUNS = [  # model, local batch, activation checkpointing, published WPS (tokens/s/GPU), published MFU %
    ("Llama 3 8B", 1, "selective layer", 2904, 56.8),
    ("Llama 3 8B", 1, "selective op", 2973, 58.2),
    ("Llama 3 70B", 1, "full", 331, 51.7),
    ("Llama 2 13B", 2, "no", 2162, 61.1),
    ("Llama 2 13B", 2, "selective layer", 1914, 54.1),
    ("Llama 2 13B", 2, "selective op", 1904, 53.8),
    ("Llama 2 70B", 1, "selective op", 355, 50.8),
    ("Llama 2 70B", 2, "full", 353, 50.5),
]
H100_SOURCE = (
    "https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/"
    "llama3_h100_202412_torchtitan.md"
)
H100_RUNS = [  # model, GPUs, local batch, activation checkpointing, published TPS/GPU, published memory GiB
    ("Llama 3 8B", 8, 2, "selective op", 5762, 82.4),  # Table 1, "FSDP" (no torch.compile, no Float8)
    ("Llama 3 8B", 128, 2, "selective op", 5605, 67.0),  # Table 3, "FSDP"
]
"""torchtitan's H100 benchmark (end of 2024): Llama 3.1 8B (Llama 3 8B's shape), FSDP, sequence 8192
(its llama3_8b config), "selective activation checkpointing" (taken as the config's op-level rule, an
assumption: the option is not printed beside the figures), on Grand Teton hosts: 8 H100 a host over
NVLink, "96GB HBM2e with 2.4 TB/sec", 500 W, "400 Gb/s per GPU" between hosts. Their peak FLOP/s is
"between SXM and NVL, and we don't know its exact value": each run is predicted at both ends, the
H100 SXM's 989 and the H100 NVL's 835.5 dense TFLOP/s, with the H100's calibrated efficiency. The
rows with torch.compile or Float8 are left out (neither is modelled)."""


def grand_teton(peak_tflops: float):
    """The runs' H100: the named h100-sxm with the source's memory, bandwidth and network, and a peak."""
    from offload._predict.machines import get_machine

    return get_machine("h100-sxm").replace(
        name=f"h100-96gb-hbm2e-500w@{peak_tflops:g}",
        memory_gb_per_s=2400,
        memory_bytes=96 << 30,
        peak_flops=peak_tflops * 1e12,
        internode_gb_per_s=50,
        internode="400 Gb/s a GPU (Grand Teton's RDMA network)",
    )


FIRST_PASS = (1.572, 1.682, 1.698, 1.815, 1.65, 1.735, 2.381, 1.744)
"""The ratios of ``RUNS`` (in order) this script gave first, at commit 865606a, before the network
between nodes was priced a ring per adapter (``offload/_predict/sharding.py``, Note: [a ring per
adapter]): each GPU's adapter taken to carry all of its traffic, 8x what NCCL's rings put on it.
Kept because the correction was made after seeing them: the check is held out from fitting (nothing
was fitted), not from that one structural change."""
POLICY = {  # activation checkpointing -> (policy, regions, selective rule)
    "no": ("none", "auto", "built-in"),
    "full": ("checkpoint", "auto", "built-in"),
    "selective layer": ("checkpoint", "every:2:1", "built-in"),
    "selective op": ("selective", "auto", "torchtitan-op"),
}


def _llama(name: str) -> torch.nn.Module:
    import transformers

    width, layers, heads, kv_heads, mlp, vocab, seq = SHAPES[name]
    config = transformers.LlamaConfig(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def predicted(row: tuple) -> dict[str, Any]:
    name, batch, ac, wps, mfu = row
    seq = SHAPES[name][-1]
    policy, regions, rule = POLICY[ac]
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    start = time.perf_counter()
    p = predict(
        _llama(name),
        machine=MACHINE,
        example_kwargs={"input_ids": ids, "labels": ids},
        budgets=(1.0,),
        regions=regions,
        selective_rule=rule,
        sharded_over=GPUS,
        reduce_dtype=torch.float32,
    )
    point = next(q for q in p.points if q.policy == policy)
    published_ms = batch * seq / wps * 1e3
    return {
        "model": name,
        "seq": seq,
        "local_batch": batch,
        "activation_checkpointing": ac,
        "policy": policy,
        "regions": regions,
        "selective_rule": rule,
        "published_wps": wps,
        "published_mfu_percent": mfu,
        "published_step_ms": published_ms,
        "predicted_step_ms": point.step_ms,
        "ratio": point.step_ms / published_ms,
        "collective_ms": p.sharding.collective_ms,
        "exposed_collective_ms": p.sharding.exposed_ms,
        "predicted_device_mib": point.device_bytes / (1 << 20),
        "fits_device": point.fits_device,
        "predict_s": time.perf_counter() - start,
    }


def predicted_h100(row: tuple, peak_tflops: float) -> dict[str, Any]:
    name, gpus, batch, ac, tps, memory_gib = row
    seq = SHAPES[name][-1]
    policy, regions, rule = POLICY[ac]
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    p = predict(
        _llama(name),
        machine=grand_teton(peak_tflops),
        example_kwargs={"input_ids": ids, "labels": ids},
        budgets=(1.0,),
        regions=regions,
        selective_rule=rule,
        sharded_over=gpus,
        reduce_dtype=torch.float32,
    )
    point = next(q for q in p.points if q.policy == policy)
    published_ms = batch * seq / tps * 1e3
    return {
        "model": name,
        "gpus": gpus,
        "peak_tflops": peak_tflops,
        "local_batch": batch,
        "activation_checkpointing": ac,
        "published_tps": tps,
        "published_step_ms": published_ms,
        "predicted_step_ms": point.step_ms,
        "ratio": point.step_ms / published_ms,
        "published_memory_gib": memory_gib,
        "predicted_device_gib": point.device_bytes / (1 << 30),
        "memory_ratio": point.device_bytes / (1 << 30) / memory_gib,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    results = [predicted(row) for row in RUNS]
    h100 = [predicted_h100(row, peak) for row in H100_RUNS for peak in (989.0, 835.5)]
    ratios = [r["ratio"] for r in results]
    summary = {
        "runs": len(results),
        "within_tolerance": sum(abs(x - 1) <= TOLERANCE for x in ratios),
        "median_ratio": statistics.median(ratios),
        "lowest": min(ratios),
        "highest": max(ratios),
        "h100_step_within_tolerance_at_both_peaks": sum(
            all(abs(r["ratio"] - 1) <= TOLERANCE for r in h100 if r["gpus"] == g) for g in {r["gpus"] for r in h100}
        ),
        "h100_runs": len({r["gpus"] for r in h100}),
        "memory_within_tolerance": sum(
            abs(r["memory_ratio"] - 1) <= TOLERANCE for r in h100 if r["peak_tflops"] == 989.0
        ),
        "memory_figures": len(H100_RUNS),
        "machine": MACHINE,
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predict-heldout.json").write_text(
        json.dumps(
            {"source": SOURCE, "runs": results, "h100_source": H100_SOURCE, "h100_runs": h100, "summary": summary},
            indent=1,
        )
    )
    (out / "predict-heldout.md").write_text(_markdown(results, summary) + _h100_markdown(h100))
    for r in results:
        print(
            f"{r['model']:<12} b{r['local_batch']} {r['activation_checkpointing']:<16} "
            f"published {r['published_step_ms']:>9,.1f} ms  predicted {r['predicted_step_ms']:>9,.1f} ms  "
            f"ratio {r['ratio']:.3f}"
        )
    for r in h100:
        print(
            f"H100 {r['gpus']:>3} GPUs at {r['peak_tflops']:g} TFLOP/s: step ratio {r['ratio']:.3f}, "
            f"memory {r['predicted_device_gib']:.1f} GiB predicted / {r['published_memory_gib']} published = "
            f"{r['memory_ratio']:.3f}"
        )
    print(json.dumps(summary))
    return 0


def _h100_markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "## A 96 GB, 500 W H100: torchtitan's Grand Teton runs, step time and memory",
        "",
        f"Source: {H100_SOURCE}. How they are predicted is `H100_RUNS`' note in "
        "the script: Llama 3 8B at sequence 8192, FSDP over 8 and 128 GPUs, op-level selective checkpointing "
        "(torchtitan-op), on `h100-sxm` with the source's 96 GiB, 2.4 TB/s and 400 Gb/s a GPU given, at both ends "
        "of the peak the source leaves open. Memory: the published figure (torchtitan's peak reserved GiB) against "
        "the prediction's device GiB for the row (training state, what the plan keeps, working set, transient).",
        "",
        "| GPUs | peak TFLOP/s (given) | published TPS/GPU | published step ms | predicted step ms | ratio | "
        "published GiB | predicted GiB | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['gpus']} | {r['peak_tflops']:g} | {r['published_tps']:,} | {r['published_step_ms']:,.1f} | "
            f"{r['predicted_step_ms']:,.1f} | {r['ratio']:.3f} | {r['published_memory_gib']} | "
            f"{r['predicted_device_gib']:.1f} | {r['memory_ratio']:.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


def _markdown(results: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "# offload.predict against held-out published runs: torchtitan, FSDP2 on 64 A100 80GB",
        "",
        f"`python bench/predict_heldout.py`: PREDICTIONS set against published figures; no GPU ran. Predicted on "
        f"{summary['host']}, torch {summary['torch']}, {summary['date']}.",
        "",
        f"Source of every published figure: {SOURCE} (the Llama 3 and Llama 2 tables: WPS = tokens/s per GPU, "
        "local batch as published; the step of one micro-batch = local batch x sequence / WPS). Held out: nothing "
        "in `offload/_predict` was fitted on these runs (the A100's compute efficiency 0.74 and exposed fraction "
        "0.65 were fitted on MosaicML's MPT runs, `predict-published.md`). How each run is predicted, and what is "
        'assumed where the source is silent (the network between nodes, "selective layer" as every second block), '
        "is the script's docstring.",
        "",
        "| model | seq | local batch | act. ckpt | predicted as | published WPS (MFU %) | published step ms | "
        "predicted step ms | predicted / published | exposed collectives ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        how = r["policy"] + (f", regions={r['regions']}" if r["regions"] != "auto" else "")
        how += f", rule {r['selective_rule']}" if r["policy"] == "selective" else ""
        lines.append(
            f"| {r['model']} | {r['seq']} | {r['local_batch']} | {r['activation_checkpointing']} | {how} | "
            f"{r['published_wps']:,} ({r['published_mfu_percent']}) | {r['published_step_ms']:,.1f} | "
            f"{r['predicted_step_ms']:,.1f} | {r['ratio']:.3f} | {r['exposed_collective_ms']:,.1f} |"
        )
    lines += [
        "",
        f"{summary['within_tolerance']} of {summary['runs']} within +-15 %; ratios {summary['lowest']:.3f} to "
        f"{summary['highest']:.3f}, median {summary['median_ratio']:.3f}.",
        "",
        "Not clean: the first pass of this script (commit 865606a) gave "
        + ", ".join(f"{x:.3f}" for x in FIRST_PASS)
        + " (0 of 8 within 15 %). Its cause was named before anything changed: the network between nodes was "
        "priced as if each GPU's adapter carried all of its ring traffic, while NCCL runs a ring per adapter and "
        "each adapter carries 1/8 of it (Note: [a ring per adapter] in `offload/_predict/sharding.py`). That "
        "structural correction, no fitted number, gives the table above; it was made after seeing these runs.",
        "",
        "Memory: this source publishes no memory figure (the H100 runs below do). One signal: "
        + (
            ", ".join(
                f"{r['model']} at local batch {r['local_batch']} with {r['activation_checkpointing']} "
                f"checkpointing is predicted to need {r['predicted_device_mib']:,.0f} MiB, over the A100's usable "
                "memory, yet it ran"
                for r in results
                if not r["fits_device"]
            )
            or "every run is predicted to fit the A100's usable memory, as it ran"
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
