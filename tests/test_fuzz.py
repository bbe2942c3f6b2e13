"""Property-based fuzzing: random small autograd programs, with and without the engine.

Hypothesis draws a program: a list of ops over a growing pool of tensors, each op taking its
operands from anywhere in the pool (so one tensor is reused by several ops and saved several
times). The ops cover what the store must rebuild exactly: views (slice, transpose, expand with
stride 0, as_strided), dtypes (float32, float64, bfloat16; int64 indices saved by gather and
embedding), in-place writes on fresh intermediates (legal) and on anything in the pool, saved or
not (autograd must then refuse, in forward or in backward).

Each program runs once without the engine (the reference) and once under each budget (None: keep
and count; 0: everything spills; SMALL: a couple of tensors stay), on the CPU's disk tier and on
the CUDA path's host tier (emulated with test_host_tier's deferred copies, a pinned pool of two
buffers, then disk), with ``min_offload_mb=0`` so every small tensor is managed. The outcome must
be identical: the same outputs and gradients bit for bit (NaNs included: compared as integer bits),
or the same kind of error.

One exception, the engine's documented contract (see test_engine's in-place test): where autograd
refuses a saved tensor modified in place, the engine may instead differentiate the values as
saved, once its copy has landed. That outcome is checked too, against a second reference: the
same program under hooks that snapshot each saved storage at pack time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("hypothesis", reason="property-based fuzzing needs hypothesis (pip install offload[test])")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import offload  # noqa: E402
from hb import FAST_SCHEDULES, SLOW_SCHEDULES, Schedule, detecting  # noqa: E402
from links import DeferredLink, ThreadedLink  # noqa: E402

SCHEDULES = FAST_SCHEDULES + SLOW_SCHEDULES
"""The detector's schedules, one per program (by its seed)."""

pytestmark = pytest.mark.slow  # a fuzzer: many random programs; `-m "not slow"` leaves it out

ROWS, COLS, VOCAB = 4, 6, 5
"""The base activation is ROWS x COLS (96 bytes in fp32): small enough that a run takes
milliseconds, big enough for slices, strides and broadcasts."""
SMALL_BUDGET_MB = 200 / 2**20
"""About two of the base activations stay on the device; the rest spill."""
HOST_CAP_MB = 2 * 64 / 1024
"""Two of the pinned pool's smallest buffers (64 KiB each): the host tier fills and spills to disk."""
CONFIGS = (
    (None, None),
    (0, None),
    (SMALL_BUDGET_MB, None),
    (0, "deferred"),
    (SMALL_BUDGET_MB, "deferred"),
    (0, "threaded"),
    (SMALL_BUDGET_MB, "threaded"),
    (0, "emulated"),
    (SMALL_BUDGET_MB, "emulated"),
)
"""(budget_mb, host tier link): None runs the CPU's disk tier; "emulated" is ``CudaLink`` under the
race detector (``hb.detecting``), on a schedule drawn from the program's seed."""
"""(budget_mb, through the emulated CUDA host tier)."""
MAX_OPS = 10
EXAMPLES = int(os.environ.get("OFFLOAD_FUZZ_EXAMPLES", "60"))
"""Examples per run; set OFFLOAD_FUZZ_EXAMPLES higher to hunt (the suite stays fast at 60)."""

OPS = (
    "tanh",
    "sigmoid",
    "sin",
    "square",
    "mul",
    "add",
    "matmul",
    "slice",
    "col_slice",
    "shifted_mul",
    "transpose",
    "expand",
    "as_strided",
    "bf16",
    "f64",
    "gather",
    "embedding",
    "inplace_fresh",
    "inplace_fresh_tensor",
    "inplace_any",
)

_BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: tiny ops, and a busy machine makes torch's pool spin for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    a: int
    """Operand index into the pool (modulo its size at the time)."""
    b: int
    """Second operand, for binary ops."""
    p: float
    """An op parameter in [0, 1): where a slice starts, which row expand takes, how many to gather."""


@dataclasses.dataclass(frozen=True)
class Program:
    ops: tuple
    seed: int


programs = st.builds(
    Program,
    ops=st.lists(
        st.builds(
            Op,
            name=st.sampled_from(OPS),
            a=st.integers(0, 63),
            b=st.integers(0, 63),
            p=st.floats(0, 1, exclude_max=True, allow_nan=False),
        ),
        min_size=1,
        max_size=MAX_OPS,
    ).map(tuple),
    seed=st.integers(0, 2**16),
)


def _apply(op: Op, pool: list, w: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    a = pool[op.a % len(pool)]
    b = pool[op.b % len(pool)]
    rows, cols = a.shape
    if op.name == "tanh":
        return torch.tanh(a)  # saves its output
    if op.name == "sigmoid":
        return torch.sigmoid(a)  # saves its output
    if op.name == "sin":
        return torch.sin(a)  # saves its input
    if op.name == "square":
        return a * a  # the same tensor saved twice
    if op.name == "mul":
        return a * b if a.shape == b.shape else a * a[:1]  # saves both (a broadcast view otherwise)
    if op.name == "add":
        return a + b if a.shape == b.shape else a + 1
    if op.name == "matmul":
        if COLS not in (rows, cols):
            return a @ a.mT  # the tensor and its transposed view, both saved
        x = a if cols == COLS else a.mT  # a transposed view, saved by mm
        return x @ w.to(x.dtype)  # a bf16/f64 copy of w is a managed non-leaf
    if op.name == "slice":
        start = int(op.p * rows)
        return a[start:] if start < rows else a
    if op.name == "col_slice":
        start = int(op.p * cols)
        return a[:, start:] if start < cols else a  # an offset and a row stride wider than the row
    if op.name == "shifted_mul":
        return a[:-1] * a[1:] if rows > 1 else a * a  # two overlapping views of one storage, both saved
    if op.name == "transpose":
        return a.t()
    if op.name == "expand":
        row = int(op.p * rows)
        return a[row : row + 1].expand(rows, cols)  # stride 0
    if op.name == "as_strided":
        c = a.contiguous()
        return c.as_strided(((rows + 1) // 2, cols), (2 * cols, 1), c.storage_offset())  # every other row
    if op.name == "bf16":
        return a.to(torch.bfloat16)
    if op.name == "f64":
        return a.double()
    if op.name == "gather":
        k = 1 + int(op.p * cols)
        index = torch.randint(0, cols, (rows, k))  # int64, saved
        return torch.gather(a, 1, index)
    if op.name == "embedding":
        index = torch.randint(0, VOCAB, (rows,))  # int64, saved
        return F.embedding(index, emb).to(a.dtype) + a[:, :1]
    if op.name == "inplace_fresh":
        t = a * 2  # nothing saves t yet: in-place is legal
        t.add_(1)
        return t.mul_(0.5)
    if op.name == "inplace_fresh_tensor":
        t = a + 0
        return t.mul_(b) if b.shape == a.shape else t.mul_(a)
    if op.name == "inplace_any":
        # Anything in the pool: a saved tensor (autograd must refuse in backward), a view of the
        # input leaf (refused at once), or an unsaved intermediate (legal).
        if op.p < 0.4:
            return a.mul_(1.5)
        if op.p < 0.8:
            return a.add_(0.25)
        a.detach().mul_(-1)  # through an alias that shares the version counter: still caught
        return a
    raise AssertionError(op.name)


@dataclasses.dataclass
class Outcome:
    error: Optional[str] = None
    """The kind of error: its type, and whether autograd blamed an in-place write."""
    tensors: tuple = ()
    """The loss, each pool tensor's value, and the gradients of the leaves."""


INPLACE_ERROR = "RuntimeError (in-place)"


def _kind(error: BaseException) -> str:
    inplace = "modified by an inplace operation" in str(error)
    return f"{type(error).__name__}{' (in-place)' if inplace else ''}"


def _run(program: Program, ctx=None) -> Outcome:
    """Run ``program`` (under ``ctx``, an engine or other saved-tensor hooks, for the forward only)."""
    torch.manual_seed(program.seed)
    x = torch.randn(ROWS, COLS, requires_grad=True)
    w = torch.randn(COLS, COLS, requires_grad=True)
    emb = torch.randn(VOCAB, COLS, requires_grad=True)
    try:
        if ctx is not None:
            ctx.__enter__()
        try:
            pool = [x, torch.tanh(x @ w)]
            for op in program.ops:
                pool.append(_apply(op, pool, w, emb))
            # Weights that differ per element, so a swapped or shifted saved tensor shows.
            loss = sum(
                (t.double().flatten() * torch.linspace(-1, 1, t.numel(), dtype=torch.float64)).sum() for t in pool
            )
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        loss.backward()
    except (RuntimeError, ValueError, TypeError) as error:
        return Outcome(error=_kind(error))
    values = tuple(t.detach().clone() for t in pool)
    grads = tuple(None if t.grad is None else t.grad.clone() for t in (x, w, emb))
    return Outcome(tensors=(loss.detach(),) + values + grads)


def _bits(t: Optional[torch.Tensor]):
    if t is None or not t.is_floating_point():
        return t
    return t.contiguous().view(_BITS[t.dtype])


def _assert_same(ref: Outcome, got: Outcome, where: str) -> None:
    assert ref.error == got.error, f"{where}: without the engine {ref.error or 'ran'}, with it {got.error or 'ran'}"
    assert len(ref.tensors) == len(got.tensors)
    for i, (r, g) in enumerate(zip(ref.tensors, got.tensors, strict=True)):
        assert (r is None) == (g is None), f"{where}: tensor {i} is None on one side"
        if r is not None:
            assert r.dtype == g.dtype and r.shape == g.shape, (
                f"{where}: tensor {i}: {r.dtype} {r.shape} vs {g.dtype} {g.shape}"
            )
            assert torch.equal(_bits(r), _bits(g)), f"{where}: tensor {i} differs"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs)
def test_random_programs_match_no_engine(program):
    ref = _run(program)
    with tempfile.TemporaryDirectory(prefix="offload-fuzz-") as spill_dir:
        for budget, host_tier in CONFIGS:
            with contextlib.ExitStack() as stack:
                if host_tier == "emulated":
                    schedule = SCHEDULES[program.seed % len(SCHEDULES)]
                    link = stack.enter_context(detecting(Schedule.named(schedule)))
                else:
                    link = {"deferred": DeferredLink(2), "threaded": ThreadedLink(0.001), None: None}[host_tier]
                host = {"host_budget_mb": HOST_CAP_MB} if link is not None else {}
                eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir, device="cpu", link=link, **host)
                got = _run(program, eng)
                where = f"budget_mb={budget}{f' (host tier, {host_tier} link)' if host_tier else ''}"
                _assert_same(ref, got, where)
                stats = eng.stats
                eng.close()
            if isinstance(link, ThreadedLink):
                link.close()
                assert link.sources_gone == 0, f"{where}: a copy's source was let go before the copy finished"
            assert stats.saved_tensors > 0


def test_the_fuzzer_sees_every_op():
    """A guard on the strategy itself: every op is drawn, and the in-place ones do raise somewhere."""
    seen = set()
    raised = False

    @settings(max_examples=100, deadline=None, database=None, derandomize=True)
    @given(program=programs)
    def collect(program):
        nonlocal raised
        seen.update(op.name for op in program.ops)
        raised = raised or _run(program).error is not None

    collect()
    assert seen == set(OPS) and raised
