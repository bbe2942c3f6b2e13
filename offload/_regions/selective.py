"""Selective recompute: re-run a region's cheap ops in backward, serve its expensive outputs from the tiers.

Whole-region recompute (``recompute``) drops everything a region saves and re-runs its forward,
matmuls included: one extra forward of FLOPs. But a transformer block's saved bytes are not
alike. Per byte of output, a matmul of inner size k costs ~2k FLOPs (k = 4096: ~8,000 FLOPs per
fp16 byte), attention more, a convolution ~2·C_in·kernel_area; an elementwise op, a norm, a
dropout mask or a layout copy costs a handful. Roughly half of what a block saves comes from the
cheap kind (``SelectiveProfile`` measures it per region). So a selective region:

    forward:  runs under ``_StashMode``; each EXPENSIVE op (table below) runs and its outputs are
              held; when the forward returns they are packed through the OUTER saved-tensor hooks
              (the engine's store: hot, offloaded or spilled by the budget, like any saved tensor;
              see Note: [stash packed when the forward returns]); every save the region's own
              autograd makes becomes a placeholder, as in whole-region recompute
    backward: the first unpack re-runs the forward under ``_ReplayMode``: the k-th expensive op
              is not run, it returns the k-th stashed output (same op, same input shapes and
              dtypes, or ``OffloadError`` naming the region); cheap ops run, with the RNG and
              autocast state of the forward restored, so dropout masks are equal

The re-run therefore costs the cheap ops' time and no matmul, attention or convolution FLOPs.

Why our own modes instead of torch's ``create_selective_checkpoint_contexts``: its caching mode
keeps the outputs it saves in a Python dict of detached tensors (torch 2.4 to 2.13, the range
we know), so they never reach an outer saved-tensor hook and would stay pinned on the device; the
op-indexed cache, the version check on cached entries and ignoring ``detach`` (whose count
differs between forward and recompute) are ideas taken from it. Here the stash goes through the
outer hooks, so the engine's budget governs it.

Where a region cannot be split the frame falls back to whole-region recompute (same results,
one forward of FLOPs), never to wrong gradients:
- an op in the forward writes in place into an expensive output or a view of it (``add_`` after
  a matmul): the replay would hand back the written value, so the stash is dropped (a write
  after the forward raises PyTorch's in-place error in backward instead, like any saved tensor);
- a compiled module (``torch.compile``): one autograd Function whose kernels a dispatch mode
  does not see, and that runs eagerly under one; ``Regions`` never runs it selectively.
A custom ``autograd.Function`` is fine: its forward's aten ops reach the mode in both runs, and
its ``save_for_backward`` goes through the placeholders. Ops the dispatcher does not see (a
hand-written kernel called directly) simply run again in the re-run.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .._errors import OffloadError, inplace_error
from .module_state import RegionState
from .recompute import Frame, RNGState, droppable, storage_id, synchronize_devices

__all__ = [
    "EXPENSIVE_OPS",
    "MIN_SELECTIVE_MS",
    "SelectiveProfile",
    "SelectiveRun",
    "flop_formula",
    "is_compiled",
    "is_expensive",
    "profiled_checkpoint",
    "selective_checkpoint",
]

log = logging.getLogger(__name__)


def _ops(*names: str) -> frozenset:
    """The aten op packets among ``names`` that this torch has (attention kernels vary by version)."""
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


EXPENSIVE_OPS: frozenset = _ops(
    # matmul family: ~2k FLOPs per output element (k the inner size). The composite ops
    # (``matmul``, ``linear``, ``conv2d``, ``scaled_dot_product_attention``...) decompose into
    # kernels below before a dispatch mode sees them; they are listed for a backend that
    # registers them directly.
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "matmul",
    "linear",
    "_addmm_activation",
    "_int_mm",
    "_scaled_mm",
    "_grouped_mm",  # mixture-of-experts
    "_scaled_grouped_mm",
    "_weight_int4pack_mm",  # weight-only quantized linears
    "_weight_int4pack_mm_for_cpu",
    "_weight_int8pack_mm",
    "_mixed_dtypes_linear",
    "mkldnn_linear",
    "_cslt_sparse_mm",  # 2:4 sparse
    "_sparse_semi_structured_linear",
    # attention: ~4·s·d FLOPs per output element, every fused variant and their tuple outputs
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_cudnn_attention_forward",
    # convolution: ~2·C_in·kernel_area FLOPs per output element
    "convolution",
    "_convolution",
    "convolution_overrideable",
    "cudnn_convolution",
    "mkldnn_convolution",
    "miopen_convolution",
    "conv2d",
    "conv1d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    # recurrent layers: a matmul per step
    "_cudnn_rnn",
    "mkldnn_rnn_layer",
    "miopen_rnn",
)
"""Ops whose outputs a selective region stashes instead of recomputing: those that cost hundreds
to thousands of FLOPs per output byte. Every other op is cheap (a few FLOPs per byte: elementwise,
activations, norms, softmax, dropout, layout copies, reductions) and is re-run in backward."""


MIN_SELECTIVE_MS = 1e-3
"""Least selective re-run time a profile reports, ms: the re-run less its expensive ops can come
out at or below 0 in timing noise, and 0 means "not measured" to the planner."""


def is_expensive(func: Any) -> bool:
    """Whether ``func`` (an aten OpOverload) is in ``EXPENSIVE_OPS``, in a functional overload.

    An ``out=`` overload (``aten.mm.out``) writes into a tensor the caller made; the version bump
    of that write lands after the mode has seen the op, so stashing it would always look like an
    in-place write into the stash and send the region back to whole recompute for no reason. It
    runs as a cheap op instead (re-run in backward: correct, only not saved)."""
    if getattr(func, "overloadpacket", None) not in EXPENSIVE_OPS:
        return False
    schema = getattr(func, "_schema", None)
    return schema is None or not schema.is_mutable


COMPILED_CALL = "_compiled_call_impl"
"""What ``module.compile()`` sets on the module (private to torch, 2.2+): its compiled ``_call_impl``."""


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled code (``torch.compile(module)`` or ``module.compile()``):
    one autograd Function a dispatch mode cannot split. Dynamo is looked up only if loaded; a
    module cannot be compiled without it."""
    if getattr(module, COMPILED_CALL, None) is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo")
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


def _meta(value: Any) -> tuple:
    """(shape, dtype) of every tensor in an op's arguments, in order: what a replay must match."""
    leaves, _ = tree_flatten(value)
    return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))


@dataclasses.dataclass(kw_only=True)
class _Stashed:
    """One expensive op's call in the forward: what it was, and its outputs (``_Held`` while the
    forward runs, ``_Packed`` once it returned)."""

    op: str
    inputs: tuple
    """(shape, dtype) of its tensor arguments."""
    outputs: Any
    """Its output structure with each tensor replaced."""
    rng_after: RNGState | None = None
    """The generators' states right after it ran, where it draws random numbers: see Note:
    [expensive ops that draw random numbers]."""


# Note: [expensive ops that draw random numbers]
#     A fused attention kernel with dropout (``dropout_p`` > 0: flash / efficient attention on
#     CUDA) advances the generator by what its masks took. A replay does not run it, so without
#     help every draw after it in the re-run (the next dropout) would see an earlier generator
#     position than the forward did, and its mask would differ. The kernel's own backward is not
#     the problem: it reads the seed and offset it returned, which are stashed with its outputs.
#     So the forward records the generator states right after such an op, and the replay sets
#     them after handing back its outputs. Ops without a ``dropout_p`` argument draw nothing.
def _rng_after(func: Any, args: tuple, kwargs: dict) -> RNGState | None:
    """The generator states to restore after replaying ``func``, or None if it draws nothing."""
    names = [arg.name for arg in func._schema.arguments]
    if "dropout_p" not in names:
        return None
    i = names.index("dropout_p")
    dropout_p = args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)
    if not dropout_p:
        return None
    leaves, _ = tree_flatten((args, kwargs))
    return RNGState([t for t in leaves if isinstance(t, torch.Tensor)])


class _Held:
    """An expensive op's output tensor while the region's forward runs, and its version then."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version


def _is_held(value: Any) -> bool:
    return isinstance(value, _Held)


class _Mode(TorchDispatchMode):
    """Our dispatch modes' base. torch (2.9+) wraps a mode's ``__torch_dispatch__`` to keep Dynamo
    out of it unless the class says not to, and the wrapper imports Dynamo on first use: 2.8 s
    measured here, landing inside a profiled region's forward. Nothing here is compiled, so opt out."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _StashMode(_Mode):
    """The forward's mode: runs every op; notes each expensive call and holds its outputs."""

    def __init__(self, frame: _SelectiveFrame) -> None:
        super().__init__()
        self.frame = frame

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_expensive(func):
            self.frame.stashed.append(
                _Stashed(
                    op=str(func),
                    inputs=_meta((args, kwargs)),
                    outputs=_map_tensors(_Held, out),
                    rng_after=_rng_after(func, args, kwargs),
                )
            )
        return out


def _map_tensors(fn: Callable, value: Any) -> Any:
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


class _ReplayMode(_Mode):
    """The re-run's mode: cheap ops run; the k-th expensive op returns the k-th stashed outputs."""

    def __init__(self, name: str, stashed: list, unpack: Callable, note: Callable[[], str]) -> None:
        super().__init__()
        self.name, self.stashed, self.unpack, self.note = name, stashed, unpack, note
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_expensive(func):
            return func(*args, **kwargs)
        index = self.index
        self.index += 1
        want = self.stashed[index] if index < len(self.stashed) else None
        got = (str(func), _meta((args, kwargs)))
        if want is None or (want.op, want.inputs) != got:
            expected = "nothing more" if want is None else f"{want.op} on {list(want.inputs)}"
            raise OffloadError(
                f"offload: the selective recompute of region {self.name!r} ran expensive op {index}, {got[0]} on "
                f"{list(got[1])}, but its forward ran {expected}; the region's forward must run the same ops on "
                f"the same shapes when re-run (no data-dependent branches on mutable state); exclude it from "
                f"regions=, fix the branch, or use policy='recompute'" + self.note()
            )
        out = tree_map(lambda leaf: self.unpack(leaf, index), want.outputs, is_leaf=_is_packed)
        if want.rng_after is not None:  # See Note: [expensive ops that draw random numbers]
            want.rng_after.set()
        return out


class _Packed:
    """One stashed output tensor: what the outer hooks packed, the version to check (where no outer
    hooks check it), and its storage's id and size (for the byte counts)."""

    __slots__ = ("nbytes", "packed", "storage", "version")

    def __init__(self, t: torch.Tensor, packed: Any, version: int | None) -> None:
        self.packed, self.version = packed, version
        self.storage, self.nbytes = storage_id(t), t.untyped_storage().nbytes()


def _is_packed(value: Any) -> bool:
    return isinstance(value, _Packed)


# Note: [stash packed when the forward returns]
#     Inside ``__torch_dispatch__`` the autograd and ADInplaceOrView keys are already behind us:
#     ``t.detach()`` there makes an alias on a NEW version counter, so neither our check nor the
#     store's version watch (Note: [version watch] in ``_memory.entry``) would see a later in-place write.
#     So the mode only holds each expensive output (the very tensor autograd hands on; the cycle it
#     closes through the graph lives only while the forward runs, like the saved values of Note:
#     [saved values live while the forward runs]) with its version. When the forward returns,
#     outputs the re-run never reaches are dropped, one written in place since its op ran rules the
#     split out (the replay would hand back the written value: the region is recomputed whole), and
#     the rest are packed through the outer hooks, from autograd's side, with the version watch
#     any saved tensor gets. The cost: the stash starts moving when the region's forward ends,
#     not as each output is made.
class _SelectiveFrame(Frame):
    """One call of a selective region: a recompute frame whose re-run replays the expensive ops."""

    def __init__(
        self,
        fn: Callable,
        name: str,
        args: tuple,
        kwargs: dict,
        on_recompute: Callable[[float], None] | None = None,
        state: RegionState | None = None,
        on_held: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(fn, name, args, kwargs, on_recompute, state=state, on_held=on_held)
        self.stashed: list[_Stashed] = []
        self.stash_storages: dict[int, int] = {}  # storage id -> nbytes of the stash, once forward returned
        self.stash_bytes = 0
        """Bytes of distinct storages stashed through the outer hooks (set when forward returns)."""
        self._from_store: set[int] = set()
        """Storages of the stash the latest replay was handed (the store holds them, not this frame)."""
        self.needed = 0  # expensive calls before the region's last save: all a re-run reaches
        self.splittable = True
        self.why_not = ""

    def _forward_mode(self):
        return _StashMode(self)

    def _rerun_mode(self):
        if not self.splittable:
            return super()._rerun_mode()
        self._from_store = set()
        return _ReplayMode(self.name, self.stashed, self._unpack_stashed, self.changed_note)

    def _pack_placeholder(self, t: torch.Tensor) -> Any:
        self.needed = len(self.stashed)
        return super()._pack_placeholder(t)

    def _forward_aborted(self) -> None:
        # The held outputs close a cycle through their autograd nodes back to this frame that
        # Python's collector cannot see (Note: [stash packed when the forward returns]); only
        # _forward_done breaks it, and it did not run.
        self.stashed = []

    def _kept_storages(self) -> set:
        return set(self.stash_storages)

    def _abandon(self) -> None:
        super()._abandon()  # See Note: [a frame that cannot re-run holds nothing]
        self.stashed = []

    def _forward_done(self, input_storages: set) -> None:
        """See Note: [stash packed when the forward returns]."""
        del self.stashed[self.needed :]  # the re-run stops at the region's last save
        for index, entry in enumerate(self.stashed):
            written = [h for h in _leaves(entry.outputs, _is_held) if h.tensor._version != h.version]
            if written:
                self.splittable = False
                self.why_not = f"an op wrote in place into the output of expensive op {index} ({entry.op})"
                log.debug("offload: region %r recomputed whole: %s", self.name, self.why_not)
                self.stashed = []
                return
        for entry in self.stashed:
            entry.outputs = tree_map(
                lambda h: self._stash_one(h.tensor) if _is_held(h) else h, entry.outputs, is_leaf=_is_held
            )
        self.stash_storages = {leaf.storage: leaf.nbytes for leaf in self._stashed_leaves()}
        self.stash_bytes = sum(self.stash_storages.values())

    def _stash_one(self, t: torch.Tensor) -> _Packed:
        return _Packed(t, *self._pack_input(t))

    def _stashed_leaves(self) -> list:
        return [leaf for entry in self.stashed for leaf in _leaves(entry.outputs, _is_packed)]

    def _unpack_stashed(self, leaf: Any, index: int) -> Any:
        if not isinstance(leaf, _Packed):
            return leaf
        if leaf.version is not None and leaf.packed._version != leaf.version:
            raise inplace_error(
                leaf.packed.type(),
                leaf.packed.shape,
                leaf.packed._version,
                leaf.version,
                f"the output of expensive op {index} of region {self.name!r}",
            )
        # A fresh alias: autograd gives the replayed op's output its own history, which must not
        # land on the stashed tensor (the store's, or the forward's own output).
        value = self._unpack_input(leaf.packed).detach()
        self._from_store.add(storage_id(value))
        return value

    def _held_elsewhere(self) -> set:
        return self._from_store


def _leaves(value: Any, is_leaf: Callable) -> list:
    flat, _ = tree_flatten(value, is_leaf=is_leaf)
    return [leaf for leaf in flat if is_leaf(leaf)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectiveRun:
    """What one call of a recomputed region dropped and stashed (the regions' counters and profiles)."""

    dropped_bytes: int
    """Bytes of saved tensors dropped in forward, to be regenerated in backward."""
    cheap_bytes: int
    """Of those, what a selective run drops (equal to ``dropped_bytes`` for one that ran selectively;
    for a profiled whole recompute, what selective would have dropped)."""
    stash_bytes: int
    """Bytes of expensive outputs handed to the outer hooks (0 for whole-region recompute)."""
    stashed_tensors: int
    """Tensors among them."""
    selective: bool
    """False where the region had to be recomputed whole (see the module docstring)."""
    why_not: str = ""
    """Why it was recomputed whole, where it ran selectively at first."""
    counted_bytes: int = 0
    """A profiled run asked to count: bytes of distinct storages the engine would have taken had
    the region run as is (its saves the count accepted), and the saves among them."""
    counted_tensors: int = 0


def selective_checkpoint(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    name: str,
    *,
    selective: bool = True,
    on_recompute: Callable[[float], None] | None = None,
    state: RegionState | None = None,
    on_held: Callable[[int], None] | None = None,
) -> tuple[Any, SelectiveRun]:
    """Run ``fn(*args, **kwargs)`` as a recomputed region: selectively (expensive outputs stashed
    through the outer hooks, cheap ops re-run) or, with ``selective=False``, whole. Returns its
    output and what it dropped. ``on_recompute`` gets each re-run's wall time in ms (profiling).
    ``state``: the region's modules' state across its calls (``module_state``; None: ``fn``'s own).
    ``on_held``: told the bytes the region holds itself (``Frame.on_held``)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs), _NOTHING
    frame_type = _SelectiveFrame if selective else Frame
    frame = frame_type(fn, name, args, kwargs, on_recompute, state=state, on_held=on_held)
    out = frame.run()
    if isinstance(frame, _SelectiveFrame):
        run = SelectiveRun(
            dropped_bytes=frame.dropped_bytes,
            cheap_bytes=frame.dropped_bytes,
            stash_bytes=frame.stash_bytes,
            stashed_tensors=len(frame._stashed_leaves()),
            selective=frame.splittable,
            why_not=frame.why_not,
        )
    else:
        run = SelectiveRun(
            dropped_bytes=frame.dropped_bytes,
            cheap_bytes=frame.dropped_bytes,
            stash_bytes=0,
            stashed_tensors=0,
            selective=False,
        )
    return out, run


_NOTHING = SelectiveRun(dropped_bytes=0, cheap_bytes=0, stash_bytes=0, stashed_tensors=0, selective=False)
"""What a region run without grad drops: nothing."""


_FLOP_ALIASES = {
    name: target
    for name, target in (
        ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"),
    )
    if hasattr(torch.ops.aten, name)
}
"""Ops ``torch.utils.flop_counter`` has no formula for, counted with the formula of the same
computation on another kernel (the CPU's flash attention is flash attention)."""


def flop_formula(func: Any) -> Callable | None:
    """The FLOP formula of an aten op: torch's (``FlopCounterMode``'s table, looked up at each call,
    so a formula registered later counts; each takes the op's arguments and ``out_val=`` its
    output), or that of the same computation on another kernel (``_FLOP_ALIASES``); None for an op
    with no FLOPs to count."""
    packet = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None and packet is not None and packet.__name__ in _FLOP_ALIASES:
        formula = flop_registry.get(getattr(torch.ops.aten, _FLOP_ALIASES[packet.__name__]))
    return formula


class _ProfileMode(_Mode):
    """A profiling re-run's mode: runs every op; times the expensive ones (synchronizing CUDA) and
    holds their outputs in order (the re-run's own, dropped with it); counts the FLOPs of those
    torch has a formula for (``flops``; None where a formula failed), off the clocks."""

    def __init__(self, cuda_devices: list) -> None:
        super().__init__()
        self.cuda_devices = cuda_devices
        self.expensive_ms = 0.0
        self.counting_ms = 0.0
        self.flops: int | None = 0
        self.calls: list[list[_Held]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_expensive(func):
            out = func(*args, **kwargs)
            self._count(func, args, kwargs, out)
            return out
        synchronize_devices(self.cuda_devices)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        synchronize_devices(self.cuda_devices)
        self.expensive_ms += (time.perf_counter() - start) * 1e3
        leaves, _ = tree_flatten(out)
        self.calls.append([_Held(t) for t in leaves if isinstance(t, torch.Tensor)])
        self._count(func, args, kwargs, out)
        return out

    def _count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        formula = flop_formula(func)
        if formula is None or self.flops is None:
            return
        start = time.perf_counter()
        try:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        except Exception as e:  # noqa: BLE001 - a formula that does not fit these arguments
            log.info("offload: no FLOP count for %s: %r", func, e)
            self.flops = None
        self.counting_ms += (time.perf_counter() - start) * 1e3

    def mark(self) -> _Mark:
        """Where the re-run stands now: the devices synchronized, the clock, and the ms so far."""
        synchronize_devices(self.cuda_devices)
        return _Mark(time.perf_counter(), self.expensive_ms, self.counting_ms)


@dataclasses.dataclass(frozen=True)
class _Mark:
    """A profiling re-run at one instant (``_ProfileMode.mark``)."""

    at: float
    """``time.perf_counter()``, the devices synchronized."""
    expensive_ms: float
    counting_ms: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectiveProfile:
    """What running a region selectively would cost, measured by re-running it once more."""

    selective_ms: float
    """The re-run's wall time up to the region's last save (where a selective re-run stops) less
    its expensive ops' time and the FLOP counting, ms (at least ``MIN_SELECTIVE_MS``)."""
    cheap_bytes: int
    """Bytes of saves a selective run would drop (not inputs, parameters or expensive outputs)."""
    expensive_bytes: int
    """Bytes of expensive outputs it would stash (those the re-run reaches before its last save)."""
    expensive_tensors: int
    why_not: str
    """Why the region cannot be split ("" where it can)."""
    rerun_ms: float
    """Wall time of the measuring re-run itself, ms: the profiling step's backward includes it."""
    forward_flops: int = 0
    """FLOPs of the region's forward in the ops torch's flop counter has formulas for (matmuls,
    attention, convolutions; see Note: [a profiling re-run runs to the end]). 0: not counted (a
    formula failed, or the re-run did)."""


class _ProfiledFrame(Frame):
    """A whole-region recompute (its re-run timed as usual) that, on its first recompute, re-runs
    the region once more under ``_ProfileMode`` to measure what a selective run would cost."""

    def __init__(
        self,
        fn: Callable,
        name: str,
        args: tuple,
        kwargs: dict,
        on_recompute: Callable[[float], None] | None,
        on_selective: Callable[[SelectiveProfile], None] | None,
        count: Callable[[torch.Tensor], int | None] | None = None,
        state: RegionState | None = None,
        on_held: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(fn, name, args, kwargs, on_recompute, count, state, on_held)
        self.on_selective = on_selective

    def _recompute(self) -> None:
        super()._recompute()
        if self.on_selective is not None:
            on_selective, self.on_selective = self.on_selective, None
            try:
                profile = self._profile_selective()
            except Exception as e:  # noqa: BLE001 - see below
                # The whole re-run just ran fine, so what failed is running the region under a
                # dispatch mode (a higher-order op, a kernel that refuses Python modes): the region
                # is not split, which explain() says; the step itself goes on unharmed.
                log.info("offload: region %r cannot run under a dispatch mode, so not selectively: %r", self.name, e)
                profile = SelectiveProfile(
                    selective_ms=0.0,
                    cheap_bytes=0,
                    expensive_bytes=0,
                    expensive_tensors=0,
                    rerun_ms=0.0,
                    why_not=f"re-running it under a dispatch mode raised {type(e).__name__}: {e}",
                )
            on_selective(profile)

    # Note: [a profiling re-run holds nothing after it]
    #     The re-run's graph keeps its saved variables, and each holds the hooks it was packed with:
    #     the capture hook (through ``on_save``) closes over ``mode``, whose ``calls`` hold the expensive outputs, whose
    #     ``grad_fn`` is that graph. The cycle runs through autograd's C++ graph, which Python's
    #     collector cannot see, so one region's activations would stay alive for ever, once per
    #     profiled input shape. Emptying ``captured`` and ``mode.calls`` when the re-run is done
    #     (or raised) opens it; the figures are computed from the local ``calls`` first.
    # Note: [a profiling re-run runs to the end]
    #     A recompute stops at the region's last save: what comes after it (a block's last matmul,
    #     its residual add) backward does not need. The measuring re-run goes on to the end, so its
    #     FLOP count is the whole forward's, as torch's counter gives it; its selective time is
    #     still taken at the last save (the clock read there, the devices synchronized), which is
    #     where a selective re-run stops. So on a "recompute" trial the code after a region's last
    #     save runs once more, as the code before it already does (a region with side effects
    #     belongs under policy="offload", which never re-runs). Should that code raise, the
    #     figures up to the last save stand and the FLOPs are not counted.
    def _profile_selective(self) -> SelectiveProfile:
        saved: dict[int, int] = {}  # droppable saves: storage id -> nbytes
        reached = [0]  # expensive calls made before the latest save
        saves = [0]
        mode = _ProfileMode(self.rng.cuda_devices)  # on_save holds the mode, never the frame
        last = len(self.meta)
        at_last: list[_Mark] = []  # where the re-run stood at the region's last save

        def on_save(t: torch.Tensor) -> None:
            reached[0] = len(mode.calls)
            if droppable(t):
                saved[storage_id(t)] = t.untyped_storage().nbytes()
            saves[0] += 1
            if saves[0] == last:
                at_last.append(mode.mark())

        args, kwargs = self._rebuild_args()
        inputs = {storage_id(a) for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
        start = mode.mark()
        try:
            try:
                _, total_ms = self._rerun(mode, timed=True, inputs=(args, kwargs), on_save=on_save, whole=True)
            except Exception as e:  # noqa: BLE001 - after the last save: See Note: [a profiling re-run runs to the end]
                if not at_last:
                    raise
                log.info(
                    "offload: region %r raised after its last save when re-run; its FLOPs go uncounted: %r",
                    self.name,
                    e,
                )
                total_ms, mode.flops = (mode.mark().at - start.at) * 1e3, None
            stop = at_last[0] if at_last else mode.mark()  # fewer saves than the forward made: the whole re-run
            calls = mode.calls[: reached[0]]
        finally:
            mode.calls = []  # See Note: [a profiling re-run holds nothing after it]
        held = [h for call in calls for h in call]
        stash = {storage_id(h.tensor): h.tensor.untyped_storage().nbytes() for h in held}
        written = next((i for i, call in enumerate(calls) if any(h.tensor._version != h.version for h in call)), None)
        return SelectiveProfile(
            selective_ms=max(MIN_SELECTIVE_MS, (stop.at - start.at) * 1e3 - stop.expensive_ms - stop.counting_ms),
            cheap_bytes=sum(n for key, n in saved.items() if key not in inputs and key not in stash),
            expensive_bytes=sum(stash.values()),
            expensive_tensors=len(held),
            why_not="" if written is None else f"an op wrote in place into the output of expensive op {written}",
            rerun_ms=total_ms,
            forward_flops=mode.flops or 0,
        )


def profiled_checkpoint(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    name: str,
    *,
    split: bool,
    on_recompute: Callable[[float], None],
    on_selective: Callable[[SelectiveProfile], None],
    count: Callable[[torch.Tensor], int | None] | None = None,
    state: RegionState | None = None,
    on_held: Callable[[int], None] | None = None,
) -> tuple[Any, SelectiveRun]:
    """A whole-region recompute of ``fn`` (the "recompute" profiling step) reporting each re-run's
    wall time in ms (``on_recompute``); with ``split``, its first recompute also measures what a
    selective run would cost (one more re-run, reported to ``on_selective``). ``split=False`` (a
    compiled region): a plain whole recompute, never under a dispatch mode. ``count``: what the
    engine would take of each save had the region run as is (``Frame.count``; the totals are
    ``SelectiveRun.counted_bytes`` and ``counted_tensors``)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs), _NOTHING
    frame = _ProfiledFrame(fn, name, args, kwargs, on_recompute, on_selective if split else None, count, state, on_held)
    out = frame.run()
    return out, SelectiveRun(
        dropped_bytes=frame.dropped_bytes,
        cheap_bytes=frame.dropped_bytes,
        stash_bytes=0,
        stashed_tensors=0,
        selective=False,
        counted_bytes=frame.counted_bytes,
        counted_tensors=frame.counted_tensors,
    )
