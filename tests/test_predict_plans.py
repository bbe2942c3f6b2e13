"""offload.predict's table and the plans users run: units, budgets, partial checkpointing, op-level rules.

Oracles: the planner's own price of the same decisions (``offload._predict`` composes it), and
byte counts taken from the prediction's own regions (the table must add them up as the regions do).
"""

from __future__ import annotations

import json

import pytest
import torch

import offload
from offload.models import GPTConfig, MiniGPT

MIB = 1 << 20


def _model(n_layer: int = 4, seq: int = 1024) -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = MiniGPT(GPTConfig(n_layer=n_layer, n_embd=512, n_head=8, seq_len=seq)).to(torch.bfloat16)
    return model, torch.zeros(2, seq, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def small():
    return _model()


# -- item 5: reading the table -----------------------------------------------------------------


def test_every_memory_figure_of_the_printout_is_in_mib(small):
    model, tokens = small
    text = str(offload.predict(model, tokens, tokens, machine="h100-sxm"))
    assert " MB" not in text and "MB " not in text
    header = text.splitlines()[text.splitlines().index("") + 1]
    assert header.split()[:9] == ["policy", "budget", "budget", "MiB", "peak", "MiB", "held", "MiB", "step"]


def test_a_policy_whose_peak_exceeds_a_budget_is_marked_instead_of_priced(small):
    model, tokens = small
    prediction = offload.predict(model, tokens, tokens, machine="h100-sxm")
    rows = {(line.split()[0], line.split()[1]): line for line in prediction.table().splitlines()[2:]}
    none_half = next(p for p in prediction.points if p.policy == "none" and p.budget_fraction == 0.5)
    assert not none_half.fits
    assert rows[("none", "50%")].endswith("does not meet this budget")
    assert f"{none_half.step_ms:.2f}" not in rows[("none", "50%")]
    assert "does not meet" not in rows[("none", "100%")]


def test_auto_takes_a_plan_that_fits_the_device_where_one_does(small):
    """Without the device in its choice, auto at 100 % keeps everything (the fastest plan in
    budget); with the device too small for that, it takes a fitting plan of the table."""
    model, tokens = small
    roomy = offload.predict(model, tokens, tokens, machine="h100-sxm")
    auto_full = next(p for p in roomy.points if p.policy == "auto" and p.budget_fraction == 1.0)
    fitting = [p for p in roomy.points if p.policy != "auto" and p.policy not in ("none", "checkpoint") and p.fits]
    smaller = min(p.device_bytes for p in fitting)
    assert smaller < auto_full.device_bytes
    memory = (smaller + auto_full.device_bytes) // 2  # the keep-all plan no longer fits; another does
    tight = offload.predict(model, tokens, tokens, machine="h100-sxm", memory_mb=memory / 2**20)
    for fraction in (1.0, 0.5, 0.25, 0.1):
        auto = next(p for p in tight.points if p.policy == "auto" and p.budget_fraction == fraction)
        others = [
            p
            for p in tight.points
            if p.policy in ("offload", "recompute", "selective") and p.budget_fraction == fraction and p.fits
        ]
        if any(p.fits_device for p in others):
            assert auto.fits and auto.fits_device, (fraction, auto)
    auto_full_tight = next(p for p in tight.points if p.policy == "auto" and p.budget_fraction == 1.0)
    assert auto_full_tight.step_ms >= auto_full.step_ms  # it gave up speed for the device, not budget


# -- item 1: machines of the user's own ---------------------------------------------------------


@pytest.mark.parametrize(
    "name, tflops, fp8_tflops, hbm, memory_bytes, interconnect, datasheet",
    [
        ("a100-40gb-sxm", 312, None, 1555, 40960 * MIB, 300, "NVIDIA A100 Tensor Core GPU datasheet"),
        ("a100-80gb-pcie", 312, None, 1935, 81920 * MIB, 32, "NVIDIA A100 Tensor Core GPU datasheet"),
        ("h100-nvl", 835.5, 1670.5, 3900, 94 * 10**9, 64, "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL"),
        ("l40s", 362.05, 733, 864, 48 * 10**9, 32, "NVIDIA L40S GPU datasheet"),
        ("mi300x", 1307.4, 2614.9, 5300, 192 * 10**9, 448, "AMD Instinct MI300X accelerator data sheet"),
    ],
)
def test_the_common_variants_carry_their_datasheet_figures(
    name, tflops, fp8_tflops, hbm, memory_bytes, interconnect, datasheet
):
    m = offload.machine(name)
    link = {"a100-40gb-sxm": 32, "a100-80gb-pcie": 32, "h100-nvl": 64, "l40s": 32, "mi300x": 64}[name]  # PCIe 4/5
    assert (m.link_out_gb_per_s, m.link_back_gb_per_s, m.link_both_gb_per_s) == (link, link, 2 * link)
    assert m.peak_flops == pytest.approx(tflops * 1e12)
    assert m.peak_fp8_flops == (None if fp8_tflops is None else pytest.approx(fp8_tflops * 1e12))
    assert (m.memory_gb_per_s, m.memory_bytes, m.interconnect_gb_per_s) == (hbm, memory_bytes, interconnect)
    assert m.source.startswith(datasheet) and m.memory_source and m.given == ()
    assert "not calibrated" in m.assumptions.flops_source  # no published run of it was fitted


def test_the_hopper_machines_carry_their_dense_fp8_peak():
    """The datasheets give fp8 with sparsity; the dense figure is half of it."""
    fp8 = {"h100-sxm": 1979, "h100-pcie": 1513, "h200": 1979, "gh200": 1979, "a100-80gb-sxm": None}
    for name, tflops in fp8.items():
        peak = offload.machine(name).peak_fp8_flops
        assert peak == (None if tflops is None else tflops * 1e12), name


def test_the_named_nodes_carry_their_network_with_its_source():
    nodes = (("a100-80gb-sxm", 25, "ConnectX-6"), ("a100-40gb-sxm", 25, "ConnectX-6"), ("h100-sxm", 50, "ConnectX-7"))
    for name, per_gpu, adapter in (*nodes, ("h200", 50, "ConnectX-7")):
        m = offload.machine(name)
        assert (m.gpus_per_node, m.internode_gb_per_s) == (8, per_gpu)
        assert adapter in m.internode and "DGX" in m.internode
        assert "between nodes: NVIDIA DGX" in m.source and f"{adapter} VPI" in m.source
    per_node = {name: offload.machine(name).gpus_per_node for name in offload.machines()}
    assert per_node == {name: 1 if name == "gh200" else 8 for name in offload.machines()}  # a GH200 node: one
    assert offload.machine("l40s").internode_gb_per_s is None
    linked = offload.machine("gh200").with_interconnect(450, "NVLink 4")  # an HGX board's 8 unless told
    assert (linked.gpus_per_node, linked.given) == (8, ("interconnect_gb_per_s", "gpus_per_node"))
    assert offload.machine("gh200").with_interconnect(450, "NVLink 4", gpus_per_node=4).gpus_per_node == 4


def test_replace_makes_a_variant_with_its_figures_marked_given():
    h100 = offload.machine("h100-sxm")
    capped = h100.replace(name="h100-capped", peak_flops=700e12, internode_gb_per_s=25, internode="4 x 400 Gb/s")
    assert (capped.peak_flops, capped.internode_gb_per_s, capped.name) == (700e12, 25, "h100-capped")
    assert capped.given == ("peak_flops", "internode_gb_per_s")  # names and descriptions are not figures
    assert capped.figure_source("peak_flops") == "given" and capped.figure_source("memory_gb_per_s") == h100.source
    assert capped.replace(peak_flops=600e12).given == ("peak_flops", "internode_gb_per_s")  # once each
    assert capped.assumptions == h100.assumptions and h100.given == ()
    with pytest.raises(ValueError, match=r"unknown fields \['peak_tflops'\]; valid ones are: name, .*peak_flops"):
        h100.replace(peak_tflops=700)
    with pytest.raises(ValueError, match="assumptions: machine.with_assumptions"):
        h100.replace(assumptions=h100.assumptions)
    for field, bad in (("peak_flops", -1.0), ("internode_gb_per_s", 0), ("peak_fp8_flops", True)):
        with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
            h100.replace(**{field: bad})
    assert h100.replace(internode_gb_per_s=0.5, peak_fp8_flops=0.5).internode_gb_per_s == 0.5  # > 0 is enough
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="gpus_per_node must be an int >= 1"):
            h100.replace(gpus_per_node=bad)
    model, tokens = _model(n_layer=2, seq=256)
    text = str(offload.predict(model, tokens, tokens, machine=capped))
    assert "700 TFLOP/s peak dense bf16 (given)" in text
    assert "machine figures given, not from its source: peak_flops, internode_gb_per_s" in text
    assert "4 x 400 Gb/s, 25 GB/s a GPU" in text


def test_the_predict_command_takes_a_machines_figures(tmp_path, capsys):
    from offload.__main__ import main

    argv = ["predict", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    argv += ["--out", str(tmp_path), "--machine", "h100-sxm"]
    flags = ["--peak-tflops", "500", "--fp8-tflops", "1000", "--hbm-gb-per-s", "2000", "--memory-gib", "94"]
    flags += ["--host-link-gb-per-s", "20", "--interconnect-gb-per-s", "100", "--gpus-per-node", "4"]
    flags += ["--internode-gb-per-s", "12.5"]
    assert main(argv + flags) == 0
    machine = json.loads((tmp_path / "prediction.json").read_text())["machine"]
    assert (machine["peak_flops"], machine["peak_fp8_flops"], machine["memory_gb_per_s"]) == (500e12, 1000e12, 2000)
    assert machine["memory_bytes"] == 94 << 30
    assert (machine["link_out_gb_per_s"], machine["link_back_gb_per_s"], machine["link_both_gb_per_s"]) == (20, 20, 40)
    assert (machine["interconnect_gb_per_s"], machine["gpus_per_node"], machine["internode_gb_per_s"]) == (100, 4, 12.5)
    assert "peak_flops" in capsys.readouterr().out
    assert main(argv + ["--peak-tflops", "0"]) == 2
    assert "--peak-tflops: must be a number of TFLOP/s > 0, got '0'" in capsys.readouterr().err
    assert main(argv + ["--gpus-per-node", "2.5"]) == 2
    assert "--gpus-per-node must be a whole number" in capsys.readouterr().err
    assert main(argv[:-2] + ["--machine", "probe", "--peak-tflops", "5"]) == 2
    assert "--machine probe measures them" in capsys.readouterr().err


# -- item 2: FSDP across nodes ------------------------------------------------------------------


def _collective_case(gpus: int, machine) -> tuple:
    model, tokens = _model(n_layer=2, seq=256)
    whole = offload.predict(model, tokens, tokens, machine=machine, budgets=(1.0,))
    sharded = offload.predict(model, tokens, tokens, machine=machine, budgets=(1.0,), sharded_over=gpus)
    return whole, sharded


@pytest.mark.parametrize("gpus", [16, 64, 128])
def test_a_ring_across_nodes_runs_at_the_slower_link(gpus):
    """Beyond a node's 8 GPUs the ring crosses the network as well as NVLink (450): a ring per
    adapter, each adapter carries 1/8 of a GPU's traffic, so the network runs like 8 x 50 GB/s a GPU
    on an H100 node, the slower: the collectives are priced at 400 x 0.8, and the device holds 1/N."""
    h100 = offload.machine("h100-sxm")
    within, across = _collective_case(8, h100)[1], _collective_case(gpus, h100)[1]
    s = across.sharding
    assert s.collective_ms == pytest.approx(s.collective_bytes / (8 * 50 * 0.8 * 1e9) * 1e3)
    assert within.sharding.collective_ms == pytest.approx(within.sharding.collective_bytes / (450 * 0.8 * 1e9) * 1e3)
    assert s.collective_bytes == pytest.approx(within.sharding.collective_bytes * (gpus - 1) / gpus * 8 / 7, abs=2)
    assert s.static_bytes < within.sharding.static_bytes  # 1/N of the state, not 1/8
    assert "the slower of the links its ring crosses, 8 x ConnectX-7" in s.text and "(the other: NVLink 4" in s.text


def test_a_network_faster_than_the_interconnect_leaves_the_interconnect_as_the_bound():
    fast = offload.machine("h100-sxm").replace(internode_gb_per_s=100, internode="imaginary")  # 8 x 100 > 450
    s = _collective_case(16, fast)[1].sharding
    assert s.collective_ms == pytest.approx(s.collective_bytes / (450 * 0.8 * 1e9) * 1e3)
    assert "the slower of the links its ring crosses, NVLink 4" in s.text


def test_the_node_size_decides_when_the_ring_leaves_the_node():
    four = offload.machine("h100-sxm").replace(gpus_per_node=4)
    s = _collective_case(8, four)[1].sharding
    assert s.collective_ms == pytest.approx(s.collective_bytes / (4 * 50 * 0.8 * 1e9) * 1e3)  # 4 adapters
    s = _collective_case(4, four)[1].sharding
    assert s.collective_ms == pytest.approx(s.collective_bytes / (450 * 0.8 * 1e9) * 1e3)


def test_across_nodes_without_a_network_figure_is_refused_naming_the_fix():
    model, tokens = _model(n_layer=2, seq=256)
    with pytest.raises(ValueError, match="no GPU interconnect figure between nodes .* --internode-gb-per-s"):
        offload.predict(model, tokens, tokens, machine="l40s", sharded_over=16)
    assert offload.predict(model, tokens, tokens, machine="l40s", sharded_over=8).sharding.gpus == 8
    single = offload.machine("gh200").replace(internode_gb_per_s=50, internode="given")  # 1 GPU a node, no NVLink
    s = offload.predict(model, tokens, tokens, machine=single, sharded_over=4).sharding
    assert s.collective_ms == pytest.approx(s.collective_bytes / (50 * 0.8 * 1e9) * 1e3)
    networked = offload.machine("l40s").replace(internode_gb_per_s=25, internode="given")
    assert offload.predict(model, tokens, tokens, machine=networked, sharded_over=16).sharding.gpus == 16


# -- item 3: partial checkpointing --------------------------------------------------------------


def _rows(prediction) -> list[tuple]:
    return [(p.policy, p.budget_fraction, p.peak_bytes, round(p.step_ms, 9), p.decisions) for p in prediction.points]


@pytest.mark.parametrize(
    "text, pick",
    [
        ("every:2", slice(0, None, 2)),
        ("every:2:1", slice(1, None, 2)),
        ("first:3", slice(0, 3)),
        ("last:1", slice(3, 4)),
    ],
)
def test_a_selection_of_regions_predicts_as_the_blocks_it_picks(small, text, pick):
    """Oracle: the same blocks passed as modules, as Python could always pass them."""
    model, tokens = small
    by_text = offload.predict(model, tokens, tokens, machine="h100-sxm", regions=text)
    by_modules = offload.predict(model, tokens, tokens, machine="h100-sxm", regions=list(model.blocks)[pick])
    assert _rows(by_text) == _rows(by_modules)
    assert [r.name for r in by_text.regions] == [r.name for r in by_modules.regions]


def test_checkpointing_every_second_block_keeps_the_others(small):
    model, tokens = small
    every = offload.predict(model, tokens, tokens, machine="h100-sxm", regions="every:2")
    whole = offload.predict(model, tokens, tokens, machine="h100-sxm")
    point = {(p.policy, p.budget_fraction): p for p in every.points}
    all_point = {(p.policy, p.budget_fraction): p for p in whole.points}
    assert point[("checkpoint", 1.0)].decisions == "recompute x2"
    none, half, full = all_point[("none", 1.0)], point[("checkpoint", 1.0)], all_point[("checkpoint", 1.0)]
    assert full.peak_bytes < half.peak_bytes < none.peak_bytes
    assert none.step_ms < half.step_ms < full.step_ms


def test_checkpoint_partial_recomputes_only_what_the_budget_needs(small):
    model, tokens = small
    prediction = offload.predict(model, tokens, tokens, machine="h100-sxm", budgets=(1.0, 0.75, 0.5, 0.25))
    point = {(p.policy, p.budget_fraction): p for p in prediction.points}
    assert point[("checkpoint-partial", 1.0)].step_ms == point[("none", 1.0)].step_ms  # nothing re-run
    assert point[("checkpoint-partial", 1.0)].decisions == point[("none", 1.0)].decisions
    partial, full = point[("checkpoint-partial", 0.75)], point[("checkpoint", 0.75)]
    assert partial.fits and partial.peak_bytes <= partial.budget_bytes
    assert "keep" in partial.decisions and "recompute" in partial.decisions
    assert point[("none", 1.0)].step_ms < partial.step_ms < full.step_ms
    assert "checkpoint-partial" in prediction.table()


def test_the_predict_command_takes_regions(tmp_path, capsys):
    from offload.__main__ import main

    argv = ["predict", "--layers", "4", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    argv += ["--out", str(tmp_path)]
    assert main(argv + ["--regions", "every:2"]) == 0
    regions = json.loads((tmp_path / "prediction.json").read_text())["regions"]
    assert [r["name"] for r in regions if r["scope"] == "region"] == ["blocks.0", "blocks.2"]
    capsys.readouterr()
    assert main(argv + ["--regions", "every:0"]) == 2
    assert "every:K, every:K:S, first:N, last:N" in capsys.readouterr().err
    assert main(argv + ["--regions", "0,9"]) == 2
    assert "past the model's 4 blocks" in capsys.readouterr().err


def test_the_fit_summary_names_the_budget_a_partial_checkpoint_needs(small):
    """Where the step does not fit without the engine, the first line names the fastest fitting row;
    checkpoint-partial's re-runs depend on its budget, so the line says which (checkpoint's do not)."""
    model, tokens = small
    fractions = (1.0, 0.75, 0.5, 0.25)
    roomy = offload.predict(model, tokens, tokens, machine="h100-sxm", budgets=fractions)
    memory = roomy.points[0].device_bytes - 1  # "none" no longer fits
    tight = offload.predict(model, tokens, tokens, machine="h100-sxm", budgets=fractions, memory_mb=memory / 2**20)
    assert "NO without the engine" in tight.fit_summary()
    assert "yes with checkpoint-partial at 75% of the peak" in tight.fit_summary()


def test_the_printed_figures_are_the_points_in_mib_and_tflops(small):
    """Oracle: the prediction's own numbers, printed in the table's units (MiB of 2**20 bytes)."""
    model, tokens = small
    p = offload.predict(model, tokens, tokens, machine="h100-sxm", sharded_over=8)
    row = next(line for line in p.table().splitlines() if line.startswith("none ") and " 100% " in line).split()
    point = p.points[0]
    assert (point.policy, point.budget_fraction) == ("none", 1.0)
    budget, peak, held, step, device = (float(row[i].replace(",", "")) for i in (2, 3, 4, 5, 7))
    assert budget == pytest.approx(point.budget_bytes / MIB, abs=0.051)
    assert peak == pytest.approx(point.peak_bytes / MIB, abs=0.051)
    assert held == pytest.approx(point.held_bytes / MIB, abs=0.051)
    assert step == pytest.approx(point.step_ms, abs=0.0051)
    assert device == pytest.approx(point.device_bytes / MIB, abs=0.51)
    text = str(p)
    assert "compute: 0.59 of 989 TFLOP/s peak dense bf16" in text and "fp8 peak 1,979 TFLOP/s, not used" in text
    assert f"parameters {p.parameter_bytes / MIB:,.1f} MiB" in text
    assert f"held per GPU, sharded over 8: {p.sharding.static_bytes / MIB:,.1f} MiB" in text
    a100 = str(offload.predict(model, tokens, tokens, machine="a100-80gb-sxm", budgets=(1.0,)))
    assert "fp8 peak" not in a100  # the A100 has no fp8


def test_predict_sizes_are_mib_and_the_byte_keywords_warn():
    """``memory_mb`` and ``min_offload_mb`` (MiB, every size's unit); ``memory_bytes`` and
    ``min_offload_bytes`` still work for a release, each with a ``DeprecationWarning`` naming the MiB
    keyword and pointing at the caller, and give the same prediction; both memory keywords at once
    are refused."""
    from offload.models import GPTConfig, MiniGPT

    with torch.device("meta"):
        model = MiniGPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, seq_len=64))
    tokens = torch.zeros(2, 64, dtype=torch.long, device="meta")
    want = offload.predict(model, tokens, tokens, machine="h100-sxm", memory_mb=512, min_offload_mb=0)
    with pytest.warns(DeprecationWarning, match="memory_mb") as caught:
        got = offload.predict(model, tokens, tokens, machine="h100-sxm", memory_bytes=512 * 2**20, min_offload_mb=0)
    assert caught[0].filename == __file__
    assert got.memory_bytes == want.memory_bytes == 512 * 2**20
    with pytest.warns(DeprecationWarning, match="min_offload_mb"):
        old = offload.predict(model, tokens, tokens, machine="h100-sxm", memory_mb=512, min_offload_bytes=0)
    assert [p.peak_bytes for p in old.points] == [p.peak_bytes for p in want.points]
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        offload.predict(model, tokens, tokens, machine="h100-sxm", memory_mb=512, memory_bytes=1)
