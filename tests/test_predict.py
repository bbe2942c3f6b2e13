"""offload.predict: named machines, predictions on meta tensors, and the predict command.

``test_predict_internals.py`` tests, white-box, the parts ``predict`` composes (this CPU's timed
calibration, what a plan holds).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import offload
from offload import MachineProfile

# -- machines: plain numbers ------------------------------------------------------------------


def test_named_machines_carry_their_datasheet_figures():
    h100 = offload.machine("h100-sxm")
    assert h100.peak_flops == 989e12
    assert h100.memory_gb_per_s == 3350
    assert (h100.link_out_gb_per_s, h100.link_back_gb_per_s, h100.link_both_gb_per_s) == (64, 64, 128)
    assert offload.machine("a100-80gb-sxm").peak_flops == 312e12
    assert set(offload.machines()) == {
        "a100-80gb-sxm",
        "a100-40gb-sxm",
        "a100-80gb-pcie",
        "h100-sxm",
        "h100-pcie",
        "h100-nvl",
        "h200",
        "gh200",
        "l40s",
        "mi300x",
    }
    for machine in map(offload.machine, offload.machines()):
        assert "http" in machine.source  # every figure names where it comes from
        assert machine.memory_source


def test_device_memory_is_what_the_device_reports_less_context_and_allocator():
    """Issue 40, item 5: nvidia-smi's total in MiB, not the datasheet's decimal GB, and "fits" is
    against that less the CUDA context and the caching allocator's reserve, both named."""
    mib = 1 << 20
    assert offload.machine("h100-sxm").memory_bytes == 81559 * mib
    assert offload.machine("h100-pcie").memory_bytes == 81559 * mib
    assert offload.machine("h200").memory_bytes == 143771 * mib
    assert offload.machine("a100-80gb-sxm").memory_bytes == 81920 * mib
    assert "143771MiB" in offload.machine("h200").memory_source and "http" in offload.machine("h200").memory_source
    h100 = offload.machine("h100-sxm")
    assert (h100.assumptions.context_mib, h100.assumptions.allocator_fraction) == (400.0, 0.05)
    assert h100.usable_memory_bytes() == int(81559 * mib * 0.95 - 400 * mib)
    roomy = h100.with_assumptions(context_mib=0, allocator_fraction=0)
    assert roomy.usable_memory_bytes() == 81559 * mib
    with pytest.raises(ValueError, match="allocator_fraction must be a number in \\[0, 1\\)"):
        h100.with_assumptions(allocator_fraction=1.0)


def test_gh200_moves_out_at_its_measured_slower_direction():
    """Issue 40, item 4: NVLink-C2C as measured each way alone (device to host ~300 GB/s, host to
    device ~346), not the datasheet's 450 each way; offload copies out first, at the slower one."""
    gh200 = offload.machine("gh200")
    assert (gh200.link_out_gb_per_s, gh200.link_back_gb_per_s) == (300, 346)
    assert gh200.assumptions.link_fraction == 1.0, "measured copies: no fraction taken off"
    profile = gh200.machine_profile()
    assert (profile.d2h_gb_per_s, profile.h2d_gb_per_s) == (300.0, 346.0)
    assert "nvbandwidth/issues/23" in gh200.source


def test_each_gpu_has_its_own_calibrated_compute_efficiency_with_its_source():
    """Issue 40, item 1: not one flops_fraction for every GPU: A100 and H100 each carry the one
    calibrated on published runs (bench/results/predict-published.md), which names them; the
    Hopper machines without a published run of their own say they take the H100's."""
    a100, h100 = offload.machine("a100-80gb-sxm").assumptions, offload.machine("h100-sxm").assumptions
    assert a100.flops_fraction > h100.flops_fraction, "published bf16 runs reach more of the A100's peak"
    for machine in (a100, h100):
        assert "llm-foundry" in machine.flops_source and "calibrated" in machine.flops_source
    for name in ("h200", "gh200", "h100-pcie"):
        assumed = offload.machine(name).assumptions
        assert assumed.flops_fraction == h100.flops_fraction and "not calibrated" in assumed.flops_source
    given = offload.machine("h100-sxm").with_assumptions(flops_fraction=0.5)
    assert given.assumptions.flops_source == "given (0.5)"


def test_achieved_figures_are_peak_times_the_named_assumptions():
    h200 = offload.machine("h200").with_assumptions(flops_fraction=0.5, memory_fraction=0.75, link_fraction=0.25)
    assert h200.achieved_flops() == 989e12 * 0.5
    assert h200.achieved_memory_gb_per_s() == 4800 * 0.75
    assert h200.achieved_link_gb_per_s() == (16.0, 16.0, 16.0)
    profile = h200.machine_profile()
    assert (profile.device_type, profile.d2h_gb_per_s, profile.h2d_gb_per_s) == ("cuda", 16.0, 16.0)
    assert offload.machine("h200").assumptions.flops_fraction == offload.machine("h100-sxm").assumptions.flops_fraction


def test_bad_assumptions_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match="flops_fraction must be a number in"):
        offload.machine("h100-sxm").with_assumptions(flops_fraction=1.5)
    with pytest.raises(ValueError, match="valid ones are: flops_fraction"):
        offload.machine("h100-sxm").with_assumptions(flop_fraction=0.5)
    with pytest.raises(ValueError, match="named machines are: a100-40gb-sxm, a100-80gb-pcie, a100-80gb-sxm"):
        offload.machine("h300")


def test_a_probe_becomes_a_machine_with_measured_figures():
    profile = MachineProfile(
        device_type="cpu", device_name="x", disk_write_gb_per_s=0.5, disk_read_gb_per_s=2.0, per_tensor_overhead_us=7
    )
    machine = offload.Machine.from_probe(
        profile, flops=1e11, memory_gb_per_s=5.0, memory_bytes=24 * 10**9, op_overhead_us=3.0
    )
    assert machine.achieved_flops() == 1e11  # measured: fractions are 1
    assert machine.achieved_memory_gb_per_s() == 5.0
    assert machine.assumptions.op_overhead_us == 3.0
    back = machine.machine_profile()
    assert (back.device_type, back.disk_write_gb_per_s, back.disk_read_gb_per_s) == ("cpu", 0.5, 2.0)
    assert back.per_tensor_overhead_us == 7
    assert back.spare_cores == 0
    spare = offload.Machine.from_probe(
        dataclasses.replace(profile, spare_cores=1), flops=1e11, memory_gb_per_s=5.0, memory_bytes=1, op_overhead_us=3
    )
    assert spare.spare_cores == 1 and spare.machine_profile().spare_cores == 1, "the planner's timeline follows"
    with pytest.raises(ValueError, match="spare_cores"):
        dataclasses.replace(spare, spare_cores=-1)
    with pytest.raises(ValueError, match="unusable link"):
        offload.Machine.from_probe(
            MachineProfile(device_type="cuda"), flops=1, memory_gb_per_s=1, memory_bytes=1, op_overhead_us=0
        )


# -- predictions on meta tensors ----------------------------------------------------------------

import resource  # noqa: E402

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from offload import OffloadError, Scope, predict  # noqa: E402
from offload.models import GPTConfig, MiniGPT  # noqa: E402

CPU = offload.Machine.from_probe(
    MachineProfile(device_type="cpu", device_name="test", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0),
    flops=50e9,
    memory_gb_per_s=10.0,
    memory_bytes=8 * 10**9,
    op_overhead_us=5.0,
)
"""A made-up CPU: the figures below that depend on it are computed from these numbers alone."""
TABLED = {"none", "checkpoint", "checkpoint-partial", "offload", "recompute", "selective", "auto"}
"""The policies every prediction tables (``docs/predict.md``)."""


def _tiny(attention: str = "sdpa", longest: int = 128) -> tuple[MiniGPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=3, n_embd=64, n_head=4, seq_len=longest, attention=attention))
    idx = torch.randint(0, 256, (2, 129))
    return model, idx[:, :-1], idx[:, 1:]


def _measured_profiles(model, x, y) -> tuple:
    """What the engine measures on this CPU: the profiles of its last profiling step (every stage
    ran: "measure", "recompute" with the selective split, "offload")."""
    eng = offload.engine(budget_mb=0.01, policy="auto", regions=model.blocks, model=model)
    for _ in range(4):
        with eng:
            _, loss = model(x, y)
        loss.backward()
    step = eng.profiled_steps[-1]
    eng.close()
    return step.outside[:1] + step.regions + step.outside[1:]


def test_saved_bytes_per_region_equal_a_measured_cpu_run():
    model, x, y = _tiny()
    predicted = predict(model, x, y, machine=CPU, regions=model.blocks)
    measured = _measured_profiles(model, x, y)
    assert [r.name for r in predicted.regions] == [m.name for m in measured]
    for p, m in zip(predicted.regions, measured, strict=True):
        assert (p.saved_bytes, p.num_tensors) == (m.saved_bytes, m.num_tensors), p.name
        if p.scope is Scope.REGION:
            assert p.input_bytes == m.input_bytes
            assert (p.cheap_bytes, p.expensive_bytes, p.expensive_tensors) == (
                m.cheap_bytes,
                m.expensive_bytes,
                m.expensive_tensors,
            )
    assert predicted.regions[1].saved_bytes > 0


def test_flops_are_those_flop_counter_mode_counts_on_a_real_step():
    model, x, y = _tiny(attention="math")
    predicted = predict(model, x, y, machine=CPU, regions=model.blocks)
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x, y)
        loss.backward()
    assert predicted.forward_flops + predicted.backward_flops == counter.get_total_flops()
    assert predicted.forward_flops > 0 and predicted.backward_flops > predicted.forward_flops
    for block in predicted.regions[1:-1]:  # backward ops are charged to the region whose saves they unpack
        assert 1.5 * block.forward_flops <= block.backward_flops <= 2.5 * block.forward_flops, block.name


def test_times_are_the_roofline_of_the_counted_ops():
    model, x, y = _tiny()
    slow = predict(model, x, y, machine=CPU, regions=model.blocks)
    fast = predict(model, x, y, machine=CPU.with_assumptions(op_overhead_us=0.0), regions=model.blocks)
    block = slow.regions[1]
    # every op pays the fixed cost once: removing it removes exactly ops x 5 us
    assert block.forward_ms - fast.regions[1].forward_ms == pytest.approx(block.forward_ops * 5e-3)
    # and without it an op costs at least its FLOPs at 50 GFLOP/s and its bytes at 10 GB/s
    assert fast.regions[1].forward_ms >= block.forward_flops / 50e9 * 1e3
    assert fast.regions[1].forward_ms >= block.forward_bytes / 10e9 * 1e3


def test_the_plan_and_every_policy_come_from_the_planner():
    model, x, y = _tiny()
    keep_peak = predict(model, x, y, machine=CPU, regions=model.blocks).plan.predicted_peak_bytes
    budget_mb = keep_peak / 2 / (1 << 20)
    p = predict(model, x, y, machine=CPU, regions=model.blocks, budget_mb=budget_mb, policy="auto")
    assert p.plan.fits_budget and p.plan.predicted_peak_bytes <= keep_peak / 2
    assert p.plan.predicted_step_ms > p.plan.baseline_step_ms  # moving bytes on a CPU is never free
    assert "0 spare core(s), the spill on the compute's cores" in str(p)
    assert {q.policy for q in p.points} == TABLED
    at_10 = {q.policy: q for q in p.points if q.budget_fraction == 0.1}
    assert at_10["none"].peak_bytes == keep_peak and not at_10["none"].fits
    assert at_10["recompute"].peak_bytes < keep_peak
    assert at_10["checkpoint"].peak_bytes == at_10["recompute"].peak_bytes
    assert at_10["auto"].step_ms <= min(q.step_ms for q in at_10.values() if q.fits) + 1e-9


def test_host_costs_are_charged_to_the_engines_policies_and_not_to_none_or_checkpoint():
    """Each saved tensor the store takes costs ``held_tensor_overhead_us``; a selective region pays
    ``dispatch_overhead_us`` per op its forward dispatches, twice; "none" and "checkpoint" run
    without the engine."""
    model, x, y = _tiny()
    bare = predict(model, x, y, machine=CPU, regions=model.blocks)
    host = CPU.with_assumptions(held_tensor_overhead_us=20.0, dispatch_overhead_us=4.0)
    charged = predict(model, x, y, machine=host, regions=model.blocks)
    for block in charged.regions[1:-1]:  # views and detaches reach a dispatch mode too
        assert block.forward_dispatches > block.forward_ops > 0
        assert block.profile().forward_dispatches == block.forward_dispatches
    step = {(p.policy, p.budget_fraction): p.step_ms for p in bare.points}
    step_charged = {(p.policy, p.budget_fraction): p.step_ms for p in charged.points}
    for policy in ("none", "checkpoint", "checkpoint-partial"):
        assert step_charged[policy, 1.0] == step[policy, 1.0]
    all_tensors = sum(c.num_tensors for c in charged.regions)
    assert step_charged["offload", 1.0] == pytest.approx(step["none", 1.0] + all_tensors * 20e-3)
    blocks = charged.regions[1:-1]
    assert all(b.profile().selective_measured() for b in blocks)
    outside_tensors = charged.regions[0].num_tensors + charged.regions[-1].num_tensors
    selective_ms = sum(2 * b.forward_dispatches * 4e-3 + b.expensive_tensors * 20e-3 for b in blocks)
    assert step_charged["selective", 1.0] == pytest.approx(
        step["selective", 1.0] + selective_ms + outside_tensors * 20e-3
    )


def test_prediction_never_touches_the_model_parameters():
    model, x, y = _tiny()
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    predict(model, x, y, machine=CPU, regions=model.blocks)
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1]), name
        assert p.grad is None, name


def test_a_model_built_on_meta_predicts_without_its_memory():
    config = GPTConfig(n_layer=4, n_embd=2048, n_head=16, seq_len=2048)
    with torch.device("meta"):
        model = MiniGPT(config)  # 200+ M parameters, never allocated
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    p = predict(model, ids, ids, machine="h100-sxm")
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert p.parameter_bytes == sum(q.numel() * 4 for q in model.parameters())
    assert growth < p.parameter_bytes / 4  # not the parameters, nor the ~GBs of activations
    assert p.regions[1].saved_bytes > 100 * (1 << 20)


def test_fused_attention_saves_no_sequence_squared_scores():
    model, x, y = _tiny()
    fused = predict(model, x, y, machine="h100-sxm", regions=model.blocks)
    written = predict(model, x, y, machine="h100-sxm", regions=model.blocks, attention="as-written")
    scores = 2 * 4 * 128 * 128 * 4  # batch x heads x seq x seq, fp32: the math path saves its probabilities
    # flash saves its output and log-sum-exp instead, and the two paths save q, k, v differently (scaled,
    # transposed), so the difference is not exactly the scores; at this shape they dominate it
    assert written.regions[1].saved_bytes - fused.regions[1].saved_bytes > scores / 2


@torch.library.custom_op("offload_test_predict::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class _Opaque(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = _opaque(block(x))
        return x.sum()


def test_an_op_without_a_meta_kernel_is_named():
    with pytest.raises(OffloadError, match="op offload_test_predict.opaque.default failed on the meta device"):
        predict(_Opaque(), torch.randn(4, 8), machine=CPU)


class _ReadsItem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if x.mean().item() > 0:  # a float read: there is no value to read on meta
            x = x * 2
        return x.sum()


def test_a_data_dependent_read_is_an_error_naming_it_and_a_bool_branch_is_assumed():
    with pytest.raises(OffloadError, match="_local_scalar_dense"):
        predict(_ReadsItem(), torch.randn(4, 8), machine=CPU)

    class Branches(_ReadsItem):
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            if (x > -1e9).all():
                x = x * 2
            return x.sum()

    p = predict(Branches(), torch.randn(4, 8), machine=CPU, min_offload_mb=0)
    assert len(p.assumed) == 1 and "test_predict.py" in p.assumed[0]


def test_longest_sequence_grows_as_a_policy_keeps_less():
    model, x, y = _tiny(longest=1024)  # the fake steps run at 256, 512 and 1024; the search goes on from their fit

    def inputs_at(seq: int):
        ids = torch.zeros(2, seq, dtype=torch.long)
        return (ids, ids), {}

    p = predict(model, x, y, machine=CPU, regions=model.blocks, longest_in=inputs_at, memory_mb=64)
    longest = {x.policy: x.sequence for x in p.longest}
    assert 0 < longest["none"] < longest["recompute"]
    assert longest["checkpoint"] == longest["recompute"]
    assert longest["auto"] >= longest["offload"] >= longest["none"]


# -- the command -------------------------------------------------------------------------------

import importlib.util  # noqa: E402
import json  # noqa: E402

from offload.__main__ import main  # noqa: E402


def test_predict_command_prints_the_table_and_writes_json(tmp_path, capsys):
    argv = ["predict", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    assert main(argv + ["--machine", "gh200", "--dtype", "fp32", "--out", str(tmp_path), "--longest"]) == 0
    out = capsys.readouterr().out
    usable = offload.machine("gh200").usable_memory_bytes() / (1 << 20)
    assert "prediction for gh200" in out and "selective" in out and f"longest sequence within {usable:,.0f} MiB" in out
    written = json.loads((tmp_path / "prediction.json").read_text())
    assert written["machine"]["name"] == "gh200"
    assert {p["policy"] for p in written["points"]} == TABLED
    assert [p["budget_fraction"] for p in written["points"][:4]] == [1.0, 0.5, 0.25, 0.1]
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional, like matplotlib
        assert (tmp_path / "pareto.png").stat().st_size > 0


def test_predict_command_reads_a_hugging_face_config_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["predict", "--hf-config", str(path), "--seq", "128", "--machine", "h200", "--out", str(tmp_path)]
    assert main(argv + ["--budgets", "50", "--budget-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0" in out and "prediction for h200" in out  # the plan at 1 MB is printed in full
    assert main(["predict", "--hf-config", str(tmp_path / "missing.json")]) == 2
    assert main(["predict", "--machine", "h300", "--layers", "2", "--width", "64", "--heads", "4"]) == 2
    assert "named machines are" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, valid",
    [
        ("--memory-gb", "-1", "a number of GB > 0"),
        ("--memory-gb", "0", "a number of GB > 0"),
        ("--memory-gb", "nan", "a number of GB > 0"),
        ("--memory-gb", "lots", "a number of GB > 0"),
        ("--budget-mb", "-5", "a number of MB >= 0"),
        ("--budget-mb", "nan", "a number of MB >= 0"),
        ("--budget-mb", "inf", "a number of MB >= 0"),
        ("--budgets", "50,-10", "a percentage of the peak without the engine >= 0"),
        ("--budgets", "50,abc", "a percentage of the peak without the engine >= 0"),
        ("--budgets", "inf", "a percentage of the peak without the engine >= 0"),
        ("--budgets", ",", "a percentage of the peak without the engine >= 0"),
    ],
)
def test_predict_command_refuses_a_bad_number_by_its_flag(flag, value, valid, tmp_path, capsys):
    """As argparse refuses a bad value (exit 2, before any work): the message names the flag, the
    value and the valid range in the flag's own unit, never an internal field, bytes or fractions."""
    argv = ["predict", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    assert main(argv + [flag, value, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and valid in err and repr(value) in err, err
    assert f"e.g. {flag} " in err, err
    for internal in ("budget_bytes", "memory_bytes", "budgets=", "fraction", "Traceback"):
        assert internal not in err, err
    assert not (tmp_path / "prediction.json").exists()


def test_predict_command_takes_budgets_over_the_peak_and_zero(tmp_path):
    """The edges of the valid ranges pass: 150 % and 0 % of the peak, a 0 MB plan."""
    argv = ["predict", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    assert main(argv + ["--budgets", "150, 0", "--budget-mb", "0", "--memory-gb", "0.5", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "prediction.json").read_text())
    assert [p["budget_fraction"] for p in written["points"][:2]] == [1.5, 0.0]


def test_regions_of_another_model_are_refused_by_name():
    model, x, y = _tiny()
    other, _, _ = _tiny()
    with pytest.raises(ValueError, match=r"regions= lists modules that are not in the model \(Block, Block"):
        predict(model, x, y, machine=CPU, regions=other.blocks)
    listed = predict(model, x, y, machine=CPU, regions=[model.blocks[0], model.blocks[2]])
    assert [r.name for r in listed.regions[1:-1]] == ["blocks.0", "blocks.2"]


# -- fused attention's own efficiency, and sharding over GPUs (issue 40, item 7) -----------------


class _Attention(torch.nn.Module):
    def __init__(self, causal: bool, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.causal, self.heads = causal, heads

    def forward(self, x):
        b, s, w = x.shape
        q = self.proj(x).view(b, s, self.heads, w // self.heads).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=self.causal)
        return out.transpose(1, 2).reshape(b, s, w)


class _Stack(torch.nn.Module):
    def __init__(self, blocks: list) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, 64)  # outside the regions: FSDP's root unit
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x.float().sum()


def test_fused_attention_is_charged_at_its_own_efficiency():
    """Named GPUs carry FlashAttention-2's published fraction of peak for SDPA's fused kernels, lower
    than their matmuls'; an attention fraction equal to the matmuls' prices the step exactly as
    none set, and a model without attention is not touched by it."""
    for name in ("a100-80gb-sxm", "h100-sxm", "h200"):
        a = offload.machine(name).assumptions
        assert a.attention_fraction < a.flops_fraction and "arXiv" in a.attention_source
    model = _Stack([_Attention(True), _Attention(True)])  # at 1024 its kernels are compute-bound
    x = torch.randn(2, 1024, 64)
    h100 = offload.machine("h100-sxm")
    as_matmuls = h100.with_assumptions(attention_fraction=None)
    same = h100.with_assumptions(attention_fraction=h100.assumptions.flops_fraction)
    slower = h100.with_assumptions(attention_fraction=0.1)
    steps = {
        m: [p.step_ms for p in predict(model, x, machine=m, budgets=(1.0,)).points] for m in (as_matmuls, same, slower)
    }
    assert steps[same] == steps[as_matmuls]
    assert all(s > a for s, a in zip(steps[slower], steps[as_matmuls], strict=True))
    assert slower.assumptions.attention_source == "given (0.1)"
    assert as_matmuls.assumptions.attention_source == "as the matmuls (given)"
    mlp = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    inputs = torch.randn(8, 64)
    plain = [p.step_ms for p in predict(mlp, inputs, machine=as_matmuls, budgets=(1.0,)).points]
    assert plain == [p.step_ms for p in predict(mlp, inputs, machine=slower, budgets=(1.0,)).points]
    with pytest.raises(ValueError, match="attention_fraction must be a number in"):
        h100.with_assumptions(attention_fraction=0.0)


@pytest.mark.parametrize("seq", [64, 128])
def test_a_causal_fused_attention_counts_half_its_scores(seq):
    """torch's FLOP formulas ignore is_causal; a causal kernel skips the masked half, and the
    published kernel efficiencies count it so: forward 4 b h s^2 d of the scores, halved, backward 2.5 x that."""
    x = torch.randn(2, seq, 64)
    full, causal = (
        predict(_Stack([_Attention(c), _Attention(c)]), x, machine="h100-sxm", budgets=(1.0,)) for c in (False, True)
    )
    scores = 4 * 2 * 4 * seq * seq * 16  # b, heads, s, s, head dim: one block's forward attention FLOPs
    assert full.forward_flops - causal.forward_flops == 2 * scores // 2
    assert full.backward_flops - causal.backward_flops == 2 * int(2.5 * scores) // 2


class _KeysAhead(torch.nn.Module):
    """Attention whose queries are the last half of the positions and whose keys are all of them
    (a prefix the queries attend to): causal, but over more keys than queries."""

    def __init__(self, causal: bool, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.causal, self.heads = causal, heads

    def forward(self, x):
        b, s, w = x.shape
        kv = self.proj(x).view(b, s, self.heads, w // self.heads).transpose(1, 2)
        q = kv[:, :, s // 2 :]
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=self.causal)
        return out.transpose(1, 2).reshape(b, s - s // 2, w)


def test_a_causal_attention_over_more_keys_than_queries_is_not_halved():
    """The halving holds where a causal call has as many keys as queries (the masked triangle is
    half the scores); with more keys the mask is no triangle, and the FLOPs count in full."""
    x = torch.randn(2, 128, 64)
    full, causal = (
        predict(_Stack([_KeysAhead(c), _KeysAhead(c)]), x, machine="h100-sxm", budgets=(1.0,)) for c in (False, True)
    )
    assert full.forward_flops == causal.forward_flops
    assert full.backward_flops == causal.backward_flops


def _sizes(model: _Stack) -> tuple[int, list[int]]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks]


@pytest.mark.parametrize("gpus", [2, 8])
@pytest.mark.parametrize("reduce", [None, torch.bfloat16], ids=["reduce-as-gradients", "reduce-bf16"])
def test_sharding_holds_a_shard_and_adds_the_exposed_collectives_to_every_step(gpus, reduce):
    """predict(sharded_over=N), as FSDP's full sharding with a unit per region: the device holds 1/N
    of the parameters, gradients and optimizer state plus what is unsharded (the root unit's
    parameters and gradients; two of the largest region's parameters and gradients, the running
    one's and the previous one's, whose reduce-scatter overlaps this backward); each step all-gathers
    the regions' parameters twice and the root's once and reduce-scatters the gradients in the
    reduce dtype, (N - 1) / N of each over the interconnect, and adds the exposed fraction of that.
    bf16 parameters, fp32 gradients, regions of unequal size and one without parameters; every
    figure below is computed from the model's sizes alone."""
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(64, 64), _Attention(True), torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())]
    blocks.append(torch.nn.GELU())  # a region with no parameters
    model = _Stack(blocks).to(torch.bfloat16)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    state = offload.OptimizerState(grad_dtype=torch.float32)
    h100 = offload.machine("h100-sxm").with_assumptions(exposed_fraction=0.5, collective_fraction=0.8)
    common = dict(machine=h100, regions=model.blocks, budgets=(1.0, 0.5), state=state)
    whole = predict(model, x, **common)
    sharded = predict(model, x, **common, sharded_over=gpus, reduce_dtype=reduce)
    params, per_block = _sizes(model)
    root = params - sum(per_block)
    n = sum(p.numel() for p in model.parameters())
    gradients = 4 * n
    reduced = (2 if reduce is torch.bfloat16 else 4) * n  # fp32 gradients, reduced in fp32 unless told
    moved = int((2 * params - root + reduced) * (gpus - 1) / gpus)
    unsharded = int(root * (1 + gradients / params) + max(per_block) * 2 * (1 + gradients / params))
    s = sharded.sharding
    assert (s.gpus, s.collective_bytes) == (gpus, moved)
    assert s.collective_ms == pytest.approx(moved / (450 * 0.8 * 1e9) * 1e3)
    assert s.exposed_ms == pytest.approx(s.collective_ms * 0.5)
    assert s.static_bytes == -(-(params + whole.state_bytes) // gpus) + unsharded
    for one, many in zip(whole.points, sharded.points, strict=True):
        assert many.step_ms == pytest.approx(one.step_ms + s.exposed_ms)
        assert one.device_bytes - many.device_bytes == params + whole.state_bytes - s.static_bytes
    assert whole.sharding.gpus == 1 and whole.sharding.static_bytes == params + whole.state_bytes
    assert f"sharded over {gpus} GPUs" in str(sharded) and "NVLink 4" in str(sharded)
    assert "FSDP's all-gathers and reduce-scatters" in sharded.to_dict()["step_includes"]
    assert "sharding: none" in str(whole)


def test_the_reduce_dtype_prices_the_reduce_scatter():
    """bf16 gradients reduce-scattered in fp32 (FSDP's reduce_dtype) move twice the gradient bytes."""
    model = _Stack([torch.nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    bf16, fp32 = (
        predict(model, x, machine="a100-80gb-sxm", regions=model.blocks, budgets=(1.0,), sharded_over=8, reduce_dtype=r)
        for r in (None, torch.float32)
    )
    n = sum(p.numel() for p in model.parameters())
    assert fp32.sharding.collective_bytes - bf16.sharding.collective_bytes == int(2 * n * 7 / 8)
    with pytest.raises(TypeError, match="reduce_dtype= takes a floating torch.dtype"):
        predict(model, x, machine="a100-80gb-sxm", regions=model.blocks, sharded_over=8, reduce_dtype=torch.int8)


def test_the_longest_sequence_of_a_sharded_step_carries_its_collectives():
    model, x, y = _tiny(longest=1024)

    def inputs_at(seq: int):
        ids = torch.zeros(2, seq, dtype=torch.long)
        return (ids, ids), {}

    common = dict(machine="h100-sxm", regions=model.blocks, longest_in=inputs_at, memory_mb=2**40)
    whole, sharded = predict(model, x, y, **common), predict(model, x, y, **common, sharded_over=8)
    for one, many in zip(whole.longest, sharded.longest, strict=True):
        assert one.sequence == many.sequence  # both at the search's cap: memory is no limit here
        assert many.step_ms == pytest.approx(one.step_ms + sharded.sharding.exposed_ms)


def test_bad_sharding_names_the_value_and_the_fix():
    model, x, y = _tiny()
    for bad in (0, True, 2.0, -8, "8"):
        with pytest.raises(ValueError, match=f"sharded_over= takes .* got {re.escape(repr(bad))}"):
            predict(model, x, y, machine="h100-sxm", regions=model.blocks, sharded_over=bad)
    assert predict(model, x, y, machine="h100-sxm", regions=model.blocks, sharded_over=np.int64(8)).sharding.gpus == 8
    for machine in (CPU, offload.machine("gh200")):
        with pytest.raises(ValueError, match="no GPU interconnect figure .* machine.with_interconnect"):
            predict(model, x, y, machine=machine, regions=model.blocks, sharded_over=2)
    linked = offload.machine("gh200").with_interconnect(450, "NVLink 4 over an NVLink switch")
    assert "NVLink 4 over an NVLink switch" in predict(model, x, y, machine=linked, sharded_over=2).sharding.text
    with pytest.raises(ValueError, match="exposed_fraction must be a number in \\[0, 1\\]"):
        offload.machine("h100-sxm").with_assumptions(exposed_fraction=1.5)


def test_predict_command_prices_sharding(tmp_path, capsys):
    argv = ["predict", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "64"]
    assert main(argv + ["--sharded-over", "8", "--reduce-dtype", "fp32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sharded over 8 GPUs (FSDP's full sharding" in out and "held per GPU, sharded over 8" in out
    assert json.loads((tmp_path / "prediction.json").read_text())["sharding"]["gpus"] == 8
    assert main(argv + ["--sharded-over", "0", "--out", str(tmp_path)]) == 2
    assert "sharded_over= takes" in capsys.readouterr().err
    assert main(argv + ["--assume", "exposed_fraction=0.25", "--sharded-over", "2", "--out", str(tmp_path)]) == 0
    assert "0.25 of it added to the step" in capsys.readouterr().out
    assert main(argv + ["--assume", "attention_fraction=none", "--out", str(tmp_path)]) == 0
    assert "fused attention kernels: as the matmuls" in capsys.readouterr().out
