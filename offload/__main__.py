"""Command line: ``python -m offload <command> ...``.

    python -m offload probe [--device D] [--spill-dir P] [--refresh] [--json]
    python -m offload predict [--model minigpt | --hf-config config.json] [--machine h100-sxm | probe]
                              [--seq 4096] [--batch 1] [--dtype bf16] [--budgets 100,50,25,10] [--longest]
                              [--attention auto|fused|as-written] [--grad-dtype D] [--master-dtype D|none]
                              [--moment-dtype D] [--assume NAME=VALUE ...] [--regions every:2]
                              [--sharded-over N] [--peak-tflops T ...] [--selective-rule RULE]

Each command is one entry in ``_COMMANDS``: a help line, a function that adds its arguments to
its sub-parser, and a function that runs it and returns the exit code. Bad input exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from ._cost import MB, MachineProfile, spill_where
from ._errors import OffloadError
from ._memory.probe import Figures, Source, probe, probe_report
from ._predict.machines import Assumptions, get_machine, machine_names
from ._predict.predict import POLICIES, Attention, OptimizerState, Prediction, predict, write_plot
from ._predict.selective_rule import RULES, SelectiveRule, get_rule
from ._predict.train_state import DTYPES
from .models import GPTConfig, MiniGPT

_EXIT_OK = 0
_EXIT_USAGE = 2
"""argparse's exit code for bad arguments; used for every kind of bad input."""


class _Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=None, help="compute device, e.g. cuda:0 or cpu (default: cuda if available)"
    )
    parser.add_argument("--spill-dir", default=None, help="directory the engine spills to (default: the temp dir)")
    parser.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--size-mb", type=int, default=64, help="MiB per timed transfer (default: 64)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="readings per figure, whose median is taken (default: 5)"
    )


def _run_probe(args: argparse.Namespace) -> int:
    try:
        report = probe_report(
            args.device, spill_dir=args.spill_dir, refresh=args.refresh, size_mb=args.size_mb, repeats=args.repeats
        )
    except ValueError as e:
        print(f"offload probe: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    profile = report.profile
    provenance = [("link, per tensor", _provenance(report.link)), ("disk", _provenance(report.disk))]
    if args.json:  # stdout stays one JSON object of the figures; where they came from goes to stderr
        print(json.dumps(dataclasses.asdict(profile)))
        for name, text in provenance:
            print(f"offload probe: {name}: {text}", file=sys.stderr)
        return _EXIT_OK

    def gb_per_s(value: float) -> str:
        return f"{value:8.2f} GB/s" if value > 0 else f"{'n/a':>8}"

    rows = [
        ("device", f"{profile.device_type} ({profile.device_name})"),
        ("device -> host", gb_per_s(profile.d2h_gb_per_s)),
        ("host -> device", gb_per_s(profile.h2d_gb_per_s)),
        ("disk write", gb_per_s(profile.disk_write_gb_per_s) + f"  (spill file, {_io(report.disk)})"),
        ("disk read", gb_per_s(profile.disk_read_gb_per_s) + f"  (spill file, {_io(report.disk)})"),
        ("per tensor", f"{profile.per_tensor_overhead_us:8.2f} us"),
        *_spare_cores_row(profile),
        *provenance,
        ("cache", str(report.cache_file)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return _EXIT_OK


def _spare_cores_row(profile: MachineProfile) -> list[tuple[str, str]]:
    """The CPU's spare cores (``MachineProfile.spare_cores``) and what the planner makes of them."""
    if profile.device_type != "cpu":
        return []
    where = spill_where(profile.spare_cores)
    return [("spare cores", f"{profile.spare_cores:8d}     ({where})")]


_DTYPES = DTYPES
_DEFAULT_OUT = Path("out") / "predict"
_ASSUMABLE = tuple(f.name for f in dataclasses.fields(Assumptions) if not f.name.endswith("_source"))
"""Assumptions ``--assume NAME=VALUE`` sets (``Machine.with_assumptions``)."""
_HF_ATTENTION = {"eager": Attention.AS_WRITTEN}
"""Hugging Face attention implementations counted otherwise than as a fused kernel; every other
("sdpa", "flash_attention_2", ...) runs a fused kernel on the GPU, and the model is built with "sdpa"."""


def _finite_number(text: str, low: float, *, low_allowed: bool) -> Optional[float]:
    """``text`` as a finite number above ``low`` (or at it, where ``low_allowed``); None if it is not one."""
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value) or value < low or (value == low and not low_allowed):
        return None
    return value


# The argparse ``type=`` of the numeric flags: a bad value is refused as argparse refuses one (exit 2),
# naming the flag, the valid range in the flag's own unit and an example.


def _memory_gb(text: str) -> float:
    value = _finite_number(text, 0, low_allowed=False)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be a number of GB > 0, got {text!r}; e.g. --memory-gb 80, or leave it out for the machine's "
            "usable memory"
        )
    return value


def _budget_mb(text: str) -> float:
    value = _finite_number(text, 0, low_allowed=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be a number of MB >= 0, got {text!r}; e.g. --budget-mb 2048")
    return value


def _budget_fractions(text: str) -> tuple[float, ...]:
    """``--budgets``: comma-separated percentages of the peak without the engine, as the fractions
    ``predict`` takes."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    fractions = []
    for item in items or [text]:
        value = _finite_number(item, 0, low_allowed=True)
        if value is None:
            raise argparse.ArgumentTypeError(
                f"each budget must be a percentage of the peak without the engine >= 0, got {item!r} in {text!r}; "
                "e.g. --budgets 100,50,25,10"
            )
        fractions.append(value / 100)
    return tuple(fractions)


_MACHINE_FLAGS: dict[str, tuple[str, str, str]] = {
    "--peak-tflops": ("peak_flops", "TFLOP/s", "peak dense bf16 TFLOP/s"),
    "--fp8-tflops": ("peak_fp8_flops", "TFLOP/s", "peak dense fp8 TFLOP/s (recorded; the step is priced in bf16)"),
    "--hbm-gb-per-s": ("memory_gb_per_s", "GB/s", "peak device memory (HBM) bandwidth, GB/s"),
    "--memory-gib": ("memory_bytes", "GiB", "device memory as the device reports it, GiB (nvidia-smi's MiB / 1024)"),
    "--host-link-gb-per-s": ("link", "GB/s", "host link, GB/s each direction (both at once: twice that)"),
    "--interconnect-gb-per-s": ("interconnect_gb_per_s", "GB/s", "GPU to GPU within a node, GB/s a direction"),
    "--gpus-per-node": ("gpus_per_node", "GPUs", "GPUs a node's interconnect joins"),
    "--internode-gb-per-s": ("internode_gb_per_s", "GB/s", "between nodes, per GPU, GB/s a direction"),
}
"""The machine flags of ``predict``: flag -> (``Machine`` field, unit, help). "link" sets the host
link's three figures."""


def _positive(flag: str, unit: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _finite_number(text, 0, low_allowed=False)
        if value is None:
            raise argparse.ArgumentTypeError(f"must be a number of {unit} > 0, got {text!r}; e.g. {flag} 8")
        return value

    return parse


def _machine_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Machine.replace`` keywords the machine flags ask for, in the fields' units."""
    changes: dict[str, Any] = {}
    for flag, (field, _, _) in _MACHINE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is None:
            continue
        if field == "link":
            changes.update(link_out_gb_per_s=value, link_back_gb_per_s=value, link_both_gb_per_s=2 * value)
        elif field in ("peak_flops", "peak_fp8_flops"):
            changes[field] = value * 1e12
        elif field == "memory_bytes":
            changes[field] = int(value * (1 << 30))
        elif field == "gpus_per_node":
            if value != int(value):
                raise ValueError(f"--gpus-per-node must be a whole number of GPUs, got {value:g}")
            changes[field] = int(value)
        else:
            changes[field] = value
    return changes


def _add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default="minigpt", choices=["minigpt"], help="built-in model (offload.models)")
    model.add_argument("--hf-config", default=None, help="a Hugging Face config.json (local file; nothing downloaded)")
    parser.add_argument("--layers", type=int, default=32, help="minigpt: blocks (default: 32)")
    parser.add_argument("--width", type=int, default=4096, help="minigpt: hidden width (default: 4096)")
    parser.add_argument("--heads", type=int, default=32, help="minigpt: attention heads (default: 32)")
    parser.add_argument("--vocab", type=int, default=32000, help="minigpt: vocabulary (default: 32000)")
    parser.add_argument(
        "--machine", default="h100-sxm", help=f"one of {', '.join(machine_names())}, or 'probe' for this one"
    )
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="parameter dtype (default: bf16)")
    parser.add_argument(
        "--budgets",
        type=_budget_fractions,
        default="100,50,25,10",
        help="budgets, %% of the peak without the engine, each >= 0 (default: 100,50,25,10)",
    )
    parser.add_argument(
        "--budget-mb", type=_budget_mb, default=None, help="the budget of the plan printed in full, MB >= 0"
    )
    parser.add_argument("--policy", default="auto", choices=POLICIES, help="the policy of that plan (default: auto)")
    parser.add_argument("--longest", action="store_true", help="search the longest sequence fitting device memory")
    parser.add_argument(
        "--regions",
        default="auto",
        help="which of the model's blocks are regions (checkpointed by 'checkpoint', managed by the engine; the "
        "others' saves kept): auto (default: all), every:K, every:K:S (from block S), first:N, last:N, or indices "
        "such as 0,3,5",
    )
    parser.add_argument(
        "--memory-gb",
        type=_memory_gb,
        default=None,
        help="device memory the step may use, GB > 0 (default: the machine's usable memory: what it reports, less the "
        "CUDA context and the allocator's reserve)",
    )
    parser.add_argument(
        "--attention",
        default="auto",
        choices=["auto", *(a.value for a in Attention)],
        help="auto (default): as the Hugging Face config's _attn_implementation says (eager: as-written), else "
        "fused; fused: SDPA as the target's flash kernel; as-written: what the model's code saves",
    )
    parser.add_argument(
        "--grad-dtype", default=None, choices=sorted(_DTYPES), help="gradients' dtype (default: the parameters')"
    )
    parser.add_argument(
        "--master-dtype",
        default="fp32",
        choices=[*sorted(_DTYPES), "none"],
        help="optimizer's master copy of the parameters (default: fp32; none: no copy)",
    )
    parser.add_argument(
        "--moment-dtype", default="fp32", choices=sorted(_DTYPES), help="dtype of Adam's two moments (default: fp32)"
    )
    parser.add_argument(
        "--sharded-over",
        type=int,
        default=1,
        metavar="GPUS",
        help="GPUs the parameters, gradients and optimizer state are sharded over, as FSDP's full sharding does: "
        "the device holds its shard and each step adds its exposed collectives, over the network between nodes "
        "beyond the machine's GPUs a node (default: 1, none)",
    )
    parser.add_argument(
        "--reduce-dtype",
        default=None,
        choices=sorted(_DTYPES),
        help="with --sharded-over: the dtype gradients are reduce-scattered in (default: the gradients')",
    )
    figures = parser.add_argument_group(
        "machine figures",
        "change the --machine's figures (a variant the table does not name: a power-capped or cloud part, a "
        "cluster's own network); each is marked given in the printout (Machine.replace)",
    )
    for flag, (_, unit, help_text) in _MACHINE_FLAGS.items():
        figures.add_argument(
            flag, type=_positive(flag, unit), default=None, metavar=unit.upper().replace(" ", "_"), help=help_text
        )
    rule = parser.add_argument_group("the selective policy's rule", "which ops the 'selective' rows save and re-run")
    rule.add_argument(
        "--selective-rule",
        default="built-in",
        choices=sorted(RULES),
        help="built-in (default: every matmul, attention and convolution saved, the rest re-run) or torchtitan-op "
        "(mm and attention saved, every second mm re-run)",
    )
    rule.add_argument(
        "--selective-saves",
        default=None,
        metavar="OPS",
        help="a rule of your own: the aten ops whose outputs are saved, e.g. mm,_scaled_dot_product_flash_attention",
    )
    rule.add_argument(
        "--selective-every-matmul",
        type=int,
        default=0,
        metavar="N",
        help="with --selective-saves: every N-th matmul of a region re-run anyway (N >= 2; default 0: none)",
    )
    parser.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"set one of the machine's assumptions, e.g. flops_fraction=0.45; names: {', '.join(_ASSUMABLE)}",
    )
    parser.add_argument(
        "--out",
        default=str(_DEFAULT_OUT),
        help=f"directory for prediction.json and pareto.png (default: {_DEFAULT_OUT})",
    )


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Attention, str]:
    """The model on meta, ``inputs_at(seq) -> (args, kwargs)``, and how attention is counted, with why."""
    dtype = _DTYPES[args.dtype]
    if args.hf_config is None:
        config = GPTConfig(
            n_layer=args.layers,
            n_embd=args.width,
            n_head=args.heads,
            vocab_size=args.vocab,
            seq_len=max(args.seq, 1024),
        )
        with torch.device("meta"):
            model: torch.nn.Module = MiniGPT(config).to(dtype)

        def gpt_inputs(seq: int) -> tuple[tuple, dict]:
            ids = torch.zeros(args.batch, seq, dtype=torch.long, device="meta")
            return (ids, ids), {}

        if args.attention == "auto":
            return model, gpt_inputs, Attention.FUSED, "--attention auto: MiniGPT calls SDPA"
        return model, gpt_inputs, Attention.of(args.attention), f"--attention {args.attention}"
    path = Path(args.hf_config)
    if not path.is_file():
        raise ValueError(f"--hf-config {path}: no such file; pass a local config.json (nothing is downloaded)")
    import transformers  # optional: needed only for --hf-config

    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    config.use_cache = False
    written = json.loads(path.read_text())
    named = written.get("_attn_implementation") or written.get("attn_implementation")
    if args.attention == "auto":
        attention = _HF_ATTENTION.get(named, Attention.FUSED)
        why = f'the config\'s "_attn_implementation": "{named}"' if named else "the config names none: sdpa"
    else:
        attention, why = Attention.of(args.attention), f"--attention {args.attention}"
    implementation = "eager" if attention is Attention.AS_WRITTEN and named == "eager" else "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).to(dtype)

    def hf_inputs(seq: int) -> tuple[tuple, dict]:
        ids = torch.zeros(args.batch, seq, dtype=torch.long, device="meta")
        return (), {"input_ids": ids, "labels": ids}

    return model, hf_inputs, attention, f"{why}; the model built with {implementation!r} attention"


def _run_predict(args: argparse.Namespace) -> int:
    try:
        for name in ("seq", "batch"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
        machine: Any = probe("cpu") if args.machine == "probe" else args.machine
        changes = _machine_changes(args)
        if args.assume or changes:
            if args.machine == "probe":
                raise ValueError(
                    "--assume and the machine figures change a named machine; --machine probe measures them"
                )
            machine = get_machine(args.machine).replace(**changes).with_assumptions(**_assumed(args.assume))
        state = OptimizerState(
            grad_dtype=None if args.grad_dtype is None else _DTYPES[args.grad_dtype],
            master_dtype=None if args.master_dtype == "none" else _DTYPES[args.master_dtype],
            moment_dtype=_DTYPES[args.moment_dtype],
        )
        model, inputs_at, attention, why = _build(args)
        example_args, example_kwargs = inputs_at(args.seq)
        prediction: Prediction = predict(
            model,
            *example_args,
            example_kwargs=example_kwargs,
            machine=machine,
            budget_mb=args.budget_mb,
            policy=args.policy,
            budgets=args.budgets,
            attention=attention,
            attention_source=why,
            state=state,
            longest_in=inputs_at if args.longest else None,
            memory_mb=None if args.memory_gb is None else args.memory_gb * 1e9 / 2**20,
            regions=args.regions,
            selective_rule=_rule(args),
            sharded_over=args.sharded_over,
            reduce_dtype=None if args.reduce_dtype is None else _DTYPES[args.reduce_dtype],
        )
    except (ValueError, TypeError, OffloadError) as e:
        print(f"offload predict: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    print(prediction)
    if args.budget_mb is not None:
        print()
        print(prediction.plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prediction.json").write_text(json.dumps(prediction.to_dict(), indent=1, default=str))
    plot = write_plot(prediction, out / "pareto.png")
    print(f"\nwritten: {out / 'prediction.json'}" + (f", {plot}" if plot is not None else " (no matplotlib: no plot)"))
    keep_mb = prediction.points[0].peak_bytes / MB
    print(f"predicted in {prediction.wall_s:.1f} s; activation peak without the engine {keep_mb:,.0f} MiB")
    return _EXIT_OK


def _rule(args: argparse.Namespace) -> SelectiveRule:
    """The selective rule the flags ask for: a named one, or one of the user's own."""
    if args.selective_saves is None:
        if args.selective_every_matmul:
            raise ValueError("--selective-every-matmul goes with --selective-saves (a rule of your own)")
        return get_rule(args.selective_rule)
    if args.selective_rule != "built-in":
        raise ValueError("--selective-rule names a rule; --selective-saves makes one: pass one of them")
    ops = frozenset(op.strip() for op in args.selective_saves.split(",") if op.strip())
    return SelectiveRule(name="given", saved_ops=ops, every_nth_matmul_recomputed=args.selective_every_matmul)


def _assumed(pairs: Sequence[str]) -> dict[str, Optional[float]]:
    """``--assume NAME=VALUE`` pairs as ``with_assumptions`` keywords (``attention_fraction=none``:
    as the matmuls); a ``ValueError`` names the bad pair and the valid names."""
    changes: dict[str, Optional[float]] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        name = name.strip()
        if name not in _ASSUMABLE:
            raise ValueError(f"--assume {pair!r}: unknown name {name!r}; valid names are: {', '.join(_ASSUMABLE)}")
        if name == "attention_fraction" and value.strip().lower() == "none":
            changes[name] = None
            continue
        try:
            changes[name] = float(value)
        except ValueError:
            raise ValueError(f"--assume {pair!r}: {value!r} is not a number; e.g. --assume {name}=0.5") from None
    return changes


def _io(disk: Figures) -> str:
    return "direct I/O, as the spill tier does it" if disk.disk_io == "direct" else disk.disk_io


def _provenance(figures: Figures) -> str:
    if figures.source is Source.MEASURED:
        return figures.describe()
    return f"{figures.describe()} (--refresh measures again)"


_COMMANDS: dict[str, _Command] = {
    "probe": _Command("measure link, disk and per-tensor costs on this machine", _add_probe_arguments, _run_probe),
    "predict": _Command(
        "predict activation peak and step time of every policy on a named machine, from the model alone",
        _add_predict_arguments,
        _run_predict,
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code."""
    parser = argparse.ArgumentParser(prog="python -m offload", description="offload: activation offloading tools")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, command in _COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help, description=command.help))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on bad arguments (2)
        return e.code if isinstance(e.code, int) else _EXIT_USAGE
    return _COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
