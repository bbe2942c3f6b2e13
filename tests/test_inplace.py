"""PyTorch's in-place check, kept under every budget and on every tier.

Saved-tensor hooks switch autograd's own check off, so the engine checks versions itself (See Note:
[version watch] in ``offload._memory.entry``). The cases are PyTorch's own (test_autograd's in-place and
saved-tensor-hook tests, in our words): a saved tensor modified after it was saved, through the
base, a view, ``detach()``, under ``no_grad``, ``inference_mode`` and anomaly mode, and a
checkpoint input changed after forward. Each must raise PyTorch's error with and without the
engine, whether the saved tensor is hot, its copy in flight, landed in host memory or on disk, or
already reloaded; and an unmodified program must run bitwise as without the engine.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import offload
from links import ThreadedLink
from zoo import wait_clean

INPLACE = "modified by an inplace operation"
N = 128  # 64 KiB of fp32: above nothing, the tests pass min_offload_mb=0 anyway


def _modify(kind: str, z: torch.Tensor) -> None:
    """Change ``z``'s values in place the way ``kind`` says, as a user might after forward."""
    if kind == "base":
        z.add_(1)
    elif kind == "view":
        z[0].mul_(2)
    elif kind == "detach":
        z.detach().add_(1)
    elif kind == "no_grad":
        with torch.no_grad():
            z.add_(1)
    elif kind == "inference_mode":
        with torch.inference_mode():
            z.add_(1)
    elif kind == "anomaly":
        with torch.autograd.detect_anomaly(check_nan=False):
            z.add_(1)
    else:
        raise AssertionError(kind)


KINDS = ("base", "view", "detach", "no_grad", "inference_mode", "anomaly")


def _engine(tier: str, budget, spill_dir, link):
    if tier == "disk":
        return offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    return offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir, device="cpu", link=link)


@pytest.fixture
def link():
    made = ThreadedLink(delay_s=0.05)  # long enough that "in flight" stays in flight
    yield made
    made.close()


def _saved_by_sin(eng, settle: bool):
    x = torch.randn(N, N, requires_grad=True)
    with eng if eng is not None else contextlib.nullcontext():
        z = x * 2
        w = z.sin()  # sin saves z
        if settle:
            h = w.cos()  # more saves, so the budget pushes z's copy out and lets it land
    if settle:
        time.sleep(0.15)
        return x, z, w + h
    return x, z, w


@pytest.mark.sweep
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget", [None, 0.1, 0], ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("tier", ["disk", "host"])
@pytest.mark.parametrize("settle", [False, True], ids=["in-flight-or-hot", "landed"])
def test_modified_after_save_raises_like_pytorch(kind, budget, tier, settle, tmp_path, link):
    torch.manual_seed(0)
    _, z, out = _saved_by_sin(None, settle)
    _modify(kind, z)
    with pytest.raises(RuntimeError, match=INPLACE) as expected:
        out.sum().backward()
    eng = _engine(tier, budget, tmp_path, link)
    torch.manual_seed(0)
    _, z, out = _saved_by_sin(eng, settle)
    _modify(kind, z)
    with pytest.raises(RuntimeError, match=INPLACE) as got:
        out.sum().backward()
    assert type(got.value) is type(expected.value)
    assert str(got.value).split(":")[0] == str(expected.value).split(":")[0]  # PyTorch's wording first
    del z, out, got, expected  # their tracebacks hold the graph
    wait_clean(eng, tmp_path)
    eng.close()


@pytest.mark.parametrize("budget", [None, 0.1, 0], ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_unmodified_runs_bitwise(budget, tier, tmp_path, link):
    torch.manual_seed(0)
    x, _, out = _saved_by_sin(None, True)
    out.sum().backward()
    want = x.grad.clone()
    eng = _engine(tier, budget, tmp_path, link)
    torch.manual_seed(0)
    x, _, out = _saved_by_sin(eng, True)
    out.sum().backward()
    assert torch.equal(x.grad, want)
    eng.close()


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_modified_after_reload_raises(budget, tmp_path):
    """retain_graph: the first backward reloads z, then z changes; the second backward must refuse."""
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=tmp_path)
    x = torch.randn(N, N, requires_grad=True)
    with eng:
        z = x * 2
        w = z.sin()
    w.sum().backward(retain_graph=True)
    z.add_(1)
    with pytest.raises(RuntimeError, match=INPLACE):
        w.sum().backward()
    eng.close()


def test_shared_storage_without_a_shared_counter_is_not_the_same_save(tmp_path):
    """``.data`` shares the storage but not the version counter: PyTorch does not see writes
    through it, and neither does the engine (no false alarm), at budget 0 and None alike. The
    write leaves the values as they were (``add_(0)``): where the saved tensor is moved, the
    engine keeps the values as saved, while PyTorch would use the storage as it is now, so only
    with unchanged values are the two gradients the same; that is what is compared."""

    def run(eng):
        torch.manual_seed(0)
        x = torch.randn(N, N, requires_grad=True)
        with eng if eng is not None else contextlib.nullcontext():
            z = x * 2
            w = z.sin()
        version = z._version
        z.data.add_(0)  # a write PyTorch does not track
        assert z._version == version, "the write went through another version counter"
        w.sum().backward()  # no in-place error: the saved tensor's counter did not move
        return x.grad

    want = run(None)
    for budget in (None, 0):
        eng = offload.engine(budget, min_offload_mb=0, spill_dir=tmp_path)
        assert torch.equal(run(eng), want), f"budget {budget}"
        eng.close()


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_checkpoint_input_changed_after_forward(budget, tmp_path):
    def region(t):
        return t.sin().exp()

    x = torch.randn(N, N, requires_grad=True)
    z = x * 2
    out = torch.utils.checkpoint.checkpoint(region, z, use_reentrant=False)
    z.add_(1)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=tmp_path)
    x = torch.randn(N, N, requires_grad=True)
    with eng:
        z = x * 2
        out = offload.checkpoint(region, z)
    z.add_(1)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()
    eng.close()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(N, N)

    def forward(self, x):
        return self.lin(x).tanh()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("budget", [None, 0.1, 0], ids=lambda b: f"budget={b}")
def test_region_input_modified_after_forward_raises(policy, budget, tmp_path):
    """Regions under policy "recompute" / "auto": a block's input changed in place after forward is
    refused in backward like torch's checkpoint refuses it, on every step (profiling included)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block(), _Block())
    if budget is None and policy == "auto":
        pytest.skip("auto without a budget keeps everything: no region is recomputed")
    eng = offload.engine(
        budget,
        regions=list(model),
        model=model,
        policy=policy,
        spill_dir=tmp_path,
        machine=_MACHINE,
        min_offload_mb=0,
    )
    for _ in range(4):  # auto: measure, recompute trial, offload trial, then its plan
        x = torch.randn(16, N, requires_grad=True)
        with eng:
            h = x * 2  # the first block's input: a non-leaf the user can still change
            out = model(h)
        out.sum().backward()  # unmodified: fine
        with eng:
            h = x * 2
            out = model(h)
        h.add_(1)
        with pytest.raises(RuntimeError, match=INPLACE):
            out.sum().backward()
        del out, h
    eng.close()


_MACHINE = offload.MachineProfile(
    device_type="cpu",
    device_name="test",
    d2h_gb_per_s=0.0,
    h2d_gb_per_s=0.0,
    disk_write_gb_per_s=1.0,
    disk_read_gb_per_s=1.0,
    per_tensor_overhead_us=50.0,
)


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_allow_mutation_on_saved_tensors_inside_the_engine(budget, tmp_path):
    """torch's ``allow_mutation_on_saved_tensors`` inside the engine: its hooks are innermost, so
    it owns what is saved there and mutation works exactly as without the engine."""

    def run(eng):
        torch.manual_seed(0)
        x = torch.randn(N, N, requires_grad=True)
        with eng if eng is not None else contextlib.nullcontext():
            with torch.autograd.graph.allow_mutation_on_saved_tensors():
                z = x * 2
                w = z.sin()
                z.add_(1)  # allowed: the saved z was cloned before the write
                w.sum().backward()
        return x.grad

    want = run(None)
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=tmp_path)
    assert torch.equal(run(eng), want)
    eng.close()


def test_engine_inside_allow_mutation_refuses_like_plain_autograd(tmp_path):
    """The other order: the engine's hooks are innermost, so ``allow_mutation_on_saved_tensors``
    never sees the saves and cannot clone them; the mutation is then refused with PyTorch's
    in-place error (never wrong gradients). Put the engine outside that context to combine them."""
    eng = offload.engine(0, min_offload_mb=0, spill_dir=tmp_path)
    x = torch.randn(N, N, requires_grad=True)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        with eng:
            z = x * 2
            w = z.sin()
        z.add_(1)
        with pytest.raises(RuntimeError, match=INPLACE):
            w.sum().backward()
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_passed_through_still_raises_like_pytorch(kind, tmp_path):
    """A tensor under ``min_offload_mb`` passes through the engine's hooks (a detached alias and
    its version, checked at unpack): modified after it was saved, backward raises PyTorch's error,
    as it does without the engine. The engine moves nothing here (budget 0, every save small)."""
    torch.manual_seed(0)
    _, z, out = _saved_by_sin(None, settle=False)
    _modify(kind, z)
    with pytest.raises(RuntimeError, match=INPLACE) as expected:
        out.sum().backward()
    eng = offload.engine(0, min_offload_mb=2 * N * N * 4 / 2**20, spill_dir=tmp_path)  # z is N*N fp32: below
    torch.manual_seed(0)
    _, z, out = _saved_by_sin(eng, settle=False)
    assert eng.stats.passthrough_tensors > 0 and eng.stats.saved_tensors == 0, "the premise: passed through"
    _modify(kind, z)
    with pytest.raises(RuntimeError, match=INPLACE) as got:
        out.sum().backward()
    assert str(got.value).split(":")[0] == str(expected.value).split(":")[0]
    del z, out, got, expected
    eng.close()
