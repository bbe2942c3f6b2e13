"""The CUDA path: side-stream copies, pinned host buffers, the device memory they free.

Every test here needs a CUDA device and is skipped cleanly without one. Oracles:

- the same model without the engine, bitwise (fp32; GEMMs and elementwise kernels on one stream
  are deterministic, TF32 is switched off; no atomics-based kernels are used);
- races provoked on purpose: the compute stream is delayed with ``torch.cuda._sleep`` so copies
  on the side stream would overtake it if they were not ordered, and freed memory is reallocated
  and filled with NaN at once, so a block freed (or reused) before its copy finished shows up as
  NaN or wrong numbers in the gradients;
- races on the side streams too: a link whose copies first spin their own stream
  (``CudaLink.before_copy``), uninitialized memory filled with NaN
  (``torch.utils.deterministic.fill_uninitialized_memory``), a new input every step so a stale
  reload cannot look right; and each race test is run once more with its guard removed (a
  keep-alive, the wait at the point of use) and must then fail (``test_cuda_guards.py``, white-box);
- the memory identity: the activation peak (forward start to backward end, weight gradients
  allocated before the window) without the engine minus with it at budget 0 is the bytes the
  engine moved, less what must be on the device anyway at the peak (the tensor in use), within
  10% of the bytes moved.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import offload
from offload.seams import CudaLink, CudaStreams, Host
from zoo import MB, wait_clean

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = int(2e7)
"""GPU clock cycles the compute stream spins per delayed layer (~10 ms at 2 GHz): a hundred times
longer than any copy here (2 MiB, ~0.1 ms), so an unordered copy certainly runs before or after
the wrong kernel; short enough that the race tests fit the gpu_check tests part."""

PINNED_BYTES_KEY = "allocated_bytes.current"
"""The caching host allocator's count of the pinned bytes it owns, in use or cached (torch 2.11
and 2.13: ``HostStats`` has allocations, allocated_bytes, active_requests, active_bytes, timings;
no reserved_bytes). ``tests/test_torch_names.py`` checks the key exists in the torch at hand."""

SCRIBBLES = 4
"""Tensors allocated and NaN-filled after each delay, to take over any block freed too early."""

PEAK_TOLERANCE = 0.10
"""Allowed gap between the measured device-memory saving and the engine's moved bytes, as a share
of the moved bytes (the caching allocator rounds blocks; grads and workspaces are the same in both
runs, but their timing relative to the peak may differ by a tensor or so)."""


@pytest.fixture(autouse=True)
def _exact_cuda_math():
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    torch.cuda.synchronize()


def chain(depth: int, width: int, *, seed: int = 0) -> nn.Module:
    """Linear + Tanh layers: each layer saves one activation (tanh's output, the next linear's input)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1)).cuda()


def step(model: nn.Module, x: torch.Tensor, eng=None) -> list[torch.Tensor]:
    """Forward (under ``eng``) and backward; returns the input's and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)  # a leaf the user holds: never the engine's
    if eng is None:
        out = model(x)
    else:
        with eng:
            out = model(x)
    loss = (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum()
    loss.backward()
    torch.cuda.synchronize()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def assert_grads_equal(ref: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert not torch.isnan(b).any(), f"{what}: gradient {i} has NaN (a block was used after it was freed)"
        assert torch.equal(a, b), f"{what}: gradient {i} differs by {(a - b).abs().max().item():.3g}"


def budget_mb_for(model: nn.Module, x: torch.Tensor, budget) -> float | None:
    if budget != "some":
        return budget
    eng = offload.engine(None, min_offload_mb=0)
    step(copy.deepcopy(model), x, eng)
    total = eng.stats.saved_bytes
    eng.close()
    return total / 3 / MB


@pytest.mark.parametrize("budget", [None, 0, "some"], ids=lambda b: f"budget={b}")
def test_gradients_bitwise_equal_on_cuda(budget, spill_dir):
    model = chain(depth=8, width=512)
    x = torch.randn(256, 512, device="cuda")
    ref = step(copy.deepcopy(model), x)
    eng = offload.engine(budget_mb_for(model, x, budget), min_offload_mb=0, spill_dir=spill_dir, model=model)
    got = step(model, x, eng)
    assert_grads_equal(ref, got, f"budget {budget}")
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_bytes > 0
    if budget is None:
        assert stats.offloaded_bytes == 0
    elif budget == 0:
        assert stats.offloaded_bytes == stats.saved_bytes
        assert 0 < stats.reloaded_bytes <= stats.saved_bytes, "each moved storage comes back at most once"
        assert stats.host_bytes > 0, "the copies went through pinned host memory"
        assert stats.d2h_busy_ms > 0 and stats.h2d_busy_ms > 0, "the side streams' busy time is measured"
    else:
        assert 0 < stats.offloaded_bytes < stats.saved_bytes
        assert stats.peak_resident_bytes <= eng.config.budget_bytes
    eng.close()


def test_cpu_engine_passes_cuda_tensors_through():
    """engine(device='cpu') leaves CUDA tensors alone; gradients are unchanged."""
    model = chain(depth=2, width=256)
    x = torch.randn(64, 256, device="cuda")
    ref = step(copy.deepcopy(model), x)
    eng = offload.engine(0, min_offload_mb=0, device="cpu")
    got = step(model, x, eng)
    assert_grads_equal(ref, got, "device=cpu")
    assert eng.stats.saved_bytes == 0 and eng.stats.passthrough_tensors > 0
    eng.close()


# ---------------------------------------------------------------------------------- races


class _DelayAndScribble(torch.autograd.Function):
    """Identity whose forward and backward first delay the compute stream, then take freed memory.

    ``torch.cuda._sleep`` queues a spinning kernel, so everything queued after it on the compute
    stream (the next layer's kernels, the NaN fills) runs late while the host races ahead and the
    engine queues copies on its side stream. The NaN-filled tensors, sized like the activations,
    are allocated from blocks the caching allocator has free now: a block the engine let go of
    before its copy finished (or a reload destination it handed out before the copy landed) gets
    NaN written into it.
    """

    @staticmethod
    def forward(ctx, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        _scribble(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SLEEP_CYCLES)
        _scribble(grad)
        return grad


def _scribble(like: torch.Tensor) -> None:
    for _ in range(SCRIBBLES):
        torch.empty_like(like).fill_(float("nan"))


class Delayed(nn.Module):
    def forward(self, x):
        return _DelayAndScribble.apply(x)


def delayed_chain(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh(), Delayed()]
    return nn.Sequential(*layers, nn.Linear(width, 1)).cuda()


class SlowLink(CudaLink):
    """CUDA side streams whose every copy first spins its own stream: a copy that the engine
    did not order after its producer, or a destination used before it landed, shows."""

    def before_copy(self, stream) -> None:
        torch.cuda._sleep(SLEEP_CYCLES // 4)


@contextlib.contextmanager
def _uninitialized_memory_is_nan():
    """Every fresh allocation is filled (NaN for floats): a reload read before it lands is garbage."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic)


ACT_BYTES = 512 * 1024 * 4
"""One activation of the race tests' chain (512 x 1024 fp32): every storage it saves is this size."""


def _race_run(budget, prefetch, spill_dir, slow_link: bool, steps: int = 2, host_budget_mb=None) -> None:
    model = delayed_chain(depth=6, width=1024)
    link = SlowLink(torch.device("cuda", torch.cuda.current_device())) if slow_link else None
    eng = offload.engine(
        budget_mb_for(model, torch.randn(512, 1024, device="cuda"), budget),
        min_offload_mb=0,
        spill_dir=spill_dir,
        prefetch=prefetch,
        model=model,
        link=link,
        host_budget_mb=host_budget_mb,
    )
    with _uninitialized_memory_is_nan():
        for i in range(steps):  # the second step reuses the pinned slabs; each step has a new input
            torch.manual_seed(100 + i)
            x = torch.randn(512, 1024, device="cuda")
            ref = step(copy.deepcopy(model), x)
            got = step(model, x, eng)
            assert_grads_equal(ref, got, f"budget {budget}, step {i}")
    stats = wait_clean(eng, spill_dir)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    if prefetch:  # the path named: reloads started ahead of their use (budget 0 leaves no room for one)
        assert stats.prefetch_misses < stats.reloaded_bytes // ACT_BYTES, stats
    if host_budget_mb is not None:
        assert stats.spilled_bytes > 0, "the host cap sent tensors on to disk"
    eng.close()


@pytest.mark.parametrize(
    "budget, prefetch, slow_link, host_budget_mb",
    [
        ("some", True, False, None),
        ("some", False, False, None),
        (0, False, True, None),
        ("some", True, True, None),
        ("some", True, True, 4),
    ],
    ids=[
        "budget=some-prefetch-compute-delayed",
        "budget=some-no-prefetch-compute-delayed",
        "budget=0-no-prefetch-side-streams-delayed",
        "budget=some-prefetch-side-streams-delayed",
        "budget=some-prefetch-host-cap-side-streams-delayed",
    ],
)
def test_delayed_streams_and_reused_memory(budget, prefetch, slow_link, host_budget_mb, spill_dir):
    """No early free, no early use: with the compute stream or the side streams delayed, freed and
    fresh memory overwritten with NaN, and a new input each step, the gradients are bitwise those
    of the model without the engine. With a host cap, host blocks are reused for reads back from
    disk while copies up from them may still be queued on the (delayed) h2d stream."""
    _race_run(budget, prefetch, spill_dir, slow_link, host_budget_mb=host_budget_mb)


def test_forward_on_a_side_stream(spill_dir):
    """The engine reads the current stream when it copies, never a cached one: a forward run on a
    user's own stream is ordered right."""
    model = delayed_chain(depth=4, width=1024)
    x = torch.randn(512, 1024, device="cuda")
    ref = step(copy.deepcopy(model), x)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, model=model)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        got = step(model, x, eng)
    torch.cuda.synchronize()
    assert_grads_equal(ref, got, "forward and backward on a user stream")
    wait_clean(eng, spill_dir)
    eng.close()


def _pinned_bytes() -> int:
    """Pinned bytes the caching host allocator owns now (a missing key is an error, not a 0)."""
    return torch.cuda.host_memory_stats()[PINNED_BYTES_KEY]


class _RecordingStreams(CudaStreams):
    """The device's own streams, noting each ``record_stream`` the link makes."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.recorded: list = []

    def record_stream(self, t, s):
        self.recorded.append(s)
        return super().record_stream(t, s)


class OnStream(nn.Module):
    """Runs ``inner`` on ``stream``, ordered after the caller's stream and before its next use, as
    an overlapped block would; autograd runs its backward on that stream too."""

    def __init__(self, inner: nn.Module, stream: "torch.cuda.Stream") -> None:
        super().__init__()
        self.inner, self.stream = inner, stream

    def forward(self, x):
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            y = self.inner(x)
        caller.wait_stream(self.stream)
        return y


def test_forward_on_two_streams_records_reloads_used_on_the_other(spill_dir):
    """Layers alternate between the default stream and a user's stream; at a budget with room to
    prefetch, reloads started by one stream's backward node are used by the other's, so the
    record_stream branch runs (See Note: [a reload used on another stream]); the gradients are
    bitwise those without the engine."""
    streams = _RecordingStreams(torch.device("cuda"))
    torch.manual_seed(0)
    user = torch.cuda.Stream()
    layers = []
    for i in range(6):
        block = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), Delayed())
        layers.append(OnStream(block, user) if i % 2 else block)
    model = nn.Sequential(*layers, nn.Linear(1024, 1)).cuda()
    x = torch.randn(512, 1024, device="cuda")
    ref = step(copy.deepcopy(model), x)
    link = CudaLink(torch.device("cuda"), streams=streams)  # the default link, over streams that log record_stream
    eng = offload.engine(budget_mb_for(model, x, "some"), min_offload_mb=0, spill_dir=spill_dir, model=model, link=link)
    got = step(model, x, eng)
    recorded = streams.recorded
    assert_grads_equal(ref, got, "layers on two streams")
    stats = wait_clean(eng, spill_dir)
    assert stats.reloaded_bytes > 0 and stats.prefetch_misses < stats.reloaded_bytes // ACT_BYTES, stats
    assert recorded, "a reload was used on a stream other than the one it was allocated on"
    eng.close()


def test_pinned_bytes_held_are_the_bytes_counted(spill_dir):
    """host_bytes is what is really pinned (the caching host allocator's own count agrees), it
    never passes host_budget_mb, and close() gives exactly that back."""
    torch.cuda.synchronize()
    Host().return_pinned()  # what other tests left cached is not counted against us
    before = _pinned_bytes()
    model = chain(depth=8, width=1024)
    x = torch.randn(1024, 1024, device="cuda")
    cap_mb = 64
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host_budget_mb=cap_mb, model=model)
    step(model, x, eng)
    stats = wait_clean(eng, spill_dir)
    pinned = _pinned_bytes() - before
    assert 0 < stats.host_bytes <= cap_mb * MB
    assert pinned == stats.host_bytes, f"pinned {pinned} bytes, counted {stats.host_bytes}"
    eng.close()
    assert eng.stats.host_bytes == 0
    assert _pinned_bytes() == before, f"close() gave back {before + pinned - _pinned_bytes()} of {pinned} bytes"


def test_host_tier_full_spills_to_disk_with_delays(spill_dir):
    """A pinned pool too small for the activations: the rest goes device -> host -> disk and back."""
    model = delayed_chain(depth=6, width=1024)
    x = torch.randn(512, 1024, device="cuda")
    ref = step(copy.deepcopy(model), x)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host_budget_mb=4, model=model)
    got = step(model, x, eng)
    assert_grads_equal(ref, got, "host cap 4 MB")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes > 0, "the host cap forced some tensors to disk"
    assert stats.host_bytes <= 4 * MB
    eng.close()


# ---------------------------------------------------------------------------------- device memory


def _activation_peak_bytes(model: nn.Module, x: torch.Tensor, eng=None) -> int:
    """Device bytes a step allocates above what was allocated at its start, from forward to the
    end of backward: weight gradients already exist (zeroed in place, not set to None), and
    nothing is cloned inside the window."""
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.zero_()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with eng if eng is not None else contextlib.nullcontext():
        out = model(x)
    loss = (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, loss, x
    return peak


def test_peak_device_memory_drops_by_the_bytes_moved(spill_dir):
    """Budget 0 on a model whose activations dominate (32 x 16 MiB vs 4 MiB weights per layer):

        peak_without - peak_with  ==  offloaded_bytes - largest_tensor   (within 10% of offloaded)

    The largest tensor is subtracted because at the peak one activation must be on the device
    with or without the engine (the one the current layer is producing or consuming).
    """
    depth, width, batch = 32, 1024, 4096
    model = chain(depth=depth, width=width)
    x = torch.randn(batch, width, device="cuda")
    largest = batch * width * 4
    _activation_peak_bytes(model, x)  # warm up: cuBLAS workspaces, handles and the grads exist in both runs
    peak_without = _activation_peak_bytes(model, x)
    # 1 MiB floor: the loss's small tensors pass through, so only the 16 MiB activations are moved
    eng = offload.engine(0, min_offload_bytes=MB, spill_dir=spill_dir, model=model)
    _activation_peak_bytes(model, x, eng)  # warm up the pinned slabs too: host memory, not device
    eng.reset_stats()
    peak_with = _activation_peak_bytes(model, x, eng)
    stats = wait_clean(eng, spill_dir)
    assert stats.offloaded_bytes == stats.saved_bytes == depth * largest, stats
    saving = peak_without - peak_with
    expected = stats.offloaded_bytes - largest
    assert abs(saving - expected) <= PEAK_TOLERANCE * stats.offloaded_bytes, (
        f"peak without {peak_without / MB:.0f} MiB, with {peak_with / MB:.0f} MiB: saved {saving / MB:.0f} MiB; "
        f"engine moved {stats.offloaded_bytes / MB:.0f} MiB, expected a saving of {expected / MB:.0f} MiB"
    )
    eng.close()
