"""Selective recompute: re-run a region's cheap ops in backward, serve its expensive outputs from the tiers.

Whole-region recompute (``_recompute``) drops everything a region saves and re-runs its forward,
matmuls included: one extra forward of FLOPs. But a transformer block's saved bytes are not
alike. Per byte of output, a matmul of inner size k costs ~2k FLOPs (k = 4096: ~8,000 FLOPs per
fp16 byte), attention more, a convolution ~2·C_in·kernel_area; an elementwise op, a norm, a
dropout mask or a layout copy costs a handful. Roughly half of what a block saves comes from the
cheap kind (see DESIGN.md, measured by producing op). So a selective region:

    forward:  runs under ``_StashMode``; each EXPENSIVE op (table below) runs and its outputs are
              packed through the OUTER saved-tensor hooks (the engine's store: hot, offloaded or
              spilled by the budget, like any saved tensor); every save the region's own autograd
              makes becomes a placeholder, as in whole-region recompute
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
- an op in the forward writes in place into a stashed output or a view of it (``relu_`` after a
  matmul): the replay would hand back the written value, so the stash is dropped;
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
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ._errors import OffloadError, inplace_error
from ._recompute import _Frame, _storage_id

__all__ = ["EXPENSIVE_OPS", "SelectiveRun", "is_compiled", "is_expensive", "selective_checkpoint"]

log = logging.getLogger(__name__)


def _ops(*names: str) -> frozenset:
    """The aten op packets among ``names`` that this torch has (attention kernels vary by version)."""
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


EXPENSIVE_OPS: frozenset = _ops(
    # matmul family: ~2k FLOPs per output element (k the inner size). ``matmul`` and ``linear``
    # decompose into these before a dispatch mode sees them on most backends; listed for those
    # where they do not.
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "matmul", "linear", "_addmm_activation",
    "_int_mm", "_scaled_mm",
    # attention: ~4·s·d FLOPs per output element, every fused variant and their tuple outputs
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
    "_cudnn_attention_forward",
    # convolution: ~2·C_in·kernel_area FLOPs per output element
    "convolution", "_convolution", "convolution_overrideable", "cudnn_convolution", "mkldnn_convolution",
    "miopen_convolution", "conv2d", "conv1d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
)
"""Ops whose outputs a selective region stashes instead of recomputing: those that cost hundreds
to thousands of FLOPs per output byte. Every other op is cheap (a few FLOPs per byte: elementwise,
activations, norms, softmax, dropout, layout copies, reductions) and is re-run in backward."""


def is_expensive(func) -> bool:
    """Whether ``func`` (an aten OpOverload) is in ``EXPENSIVE_OPS``."""
    return getattr(func, "overloadpacket", None) in EXPENSIVE_OPS


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled code (``torch.compile(module)`` or ``module.compile()``):
    one autograd Function a dispatch mode cannot split. Dynamo is looked up only if loaded; a
    module cannot be compiled without it."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo")
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)


def _meta(value) -> tuple:
    """(shape, dtype) of every tensor in an op's arguments, in order: what a replay must match."""
    leaves, _ = tree_flatten(value)
    return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def _written_tensors(func, args: tuple, kwargs: dict) -> list:
    """The tensor arguments ``func``'s schema says it writes (in-place and out= ops)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        leaves, _ = tree_flatten(value)
        written.extend(t for t in leaves if isinstance(t, torch.Tensor))
    return written


@dataclasses.dataclass(kw_only=True)
class _Stashed:
    """One expensive op's call in the forward: what it was, and its outputs packed by the outer hooks."""

    op: str
    inputs: tuple
    """(shape, dtype) of its tensor arguments."""
    outputs: Any
    """Its output structure, each tensor replaced by ``(packed, version to check or None)``."""


class _StashMode(TorchDispatchMode):
    """The forward's mode: runs every op; stashes expensive outputs; notes writes into the stash."""

    def __init__(self, frame: "_SelectiveFrame") -> None:
        super().__init__()
        self.frame = frame

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = self.frame
        if frame.stash_storages and frame.splittable:
            for t in _written_tensors(func, args, kwargs):
                if _storage_id(t) in frame.stash_storages:
                    frame.splittable = False
                    frame.why_not = f"{func} wrote in place into the output of an expensive op"
        out = func(*args, **kwargs)
        if is_expensive(func) and frame.splittable:
            frame.stash(func, args, kwargs, out)
        return out


class _ReplayMode(TorchDispatchMode):
    """The re-run's mode: cheap ops run; the k-th expensive op returns the k-th stashed outputs."""

    def __init__(self, name: str, stashed: list, unpack: Callable) -> None:
        super().__init__()
        self.name, self.stashed, self.unpack = name, stashed, unpack
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
                f"regions=, fix the branch, or use policy='recompute'"
            )
        return tree_map(lambda leaf: self.unpack(leaf, index), want.outputs, is_leaf=_is_packed)


class _Packed:
    """One stashed output tensor: what the outer hooks packed, the version to check (where no outer
    hooks check it), and its storage's id and size (for the byte counts)."""

    __slots__ = ("packed", "version", "storage", "nbytes")

    def __init__(self, t: torch.Tensor, packed, version: Optional[int]) -> None:
        self.packed, self.version = packed, version
        self.storage, self.nbytes = _storage_id(t), t.untyped_storage().nbytes()


def _is_packed(value) -> bool:
    return isinstance(value, _Packed)


class _SelectiveFrame(_Frame):
    """One call of a selective region: a recompute frame whose re-run replays the expensive ops."""

    def __init__(self, fn: Callable, name: str, args: tuple, kwargs: dict, on_recompute=None) -> None:
        super().__init__(fn, name, args, kwargs, on_recompute)
        self.stashed: list[_Stashed] = []
        self.stash_storages: dict[int, int] = {}  # storage id -> nbytes, while the forward runs
        self.stash_bytes = 0
        """Bytes of distinct storages stashed through the outer hooks (set when forward returns)."""
        self.needed = 0  # expensive calls before the region's last save: all a re-run reaches
        self.splittable = True
        self.why_not = ""

    def _forward_mode(self):
        return _StashMode(self)

    def _rerun_mode(self):
        if not self.splittable:
            return super()._rerun_mode()
        return _ReplayMode(self.name, self.stashed, self._unpack_stashed)

    def stash(self, func, args: tuple, kwargs: dict, out) -> None:
        def pack(value):
            if not isinstance(value, torch.Tensor):
                return value
            self.stash_storages[_storage_id(value)] = value.untyped_storage().nbytes()
            return _Packed(value, *self._pack_input(value))

        self.stashed.append(_Stashed(op=str(func), inputs=_meta((args, kwargs)), outputs=tree_map(pack, out)))

    def _pack_placeholder(self, t: torch.Tensor):
        self.needed = len(self.stashed)
        return super()._pack_placeholder(t)

    def _kept_storages(self) -> set:
        return set(self.stash_storages) if self.splittable else set()

    def _forward_done(self) -> None:
        # The re-run stops at the region's last save: stashed calls after it are never replayed.
        if not self.splittable:
            log.debug("offload: region %r recomputed whole: %s", self.name, self.why_not)
            self.stashed = []
        del self.stashed[self.needed :]
        self.stash_storages = {leaf.storage: leaf.nbytes for leaf in self._stashed_leaves()}
        self.stash_bytes = sum(self.stash_storages.values())

    def _stashed_leaves(self) -> list:
        leaves = []
        for entry in self.stashed:
            flat, _ = tree_flatten(entry.outputs, is_leaf=_is_packed)
            leaves.extend(leaf for leaf in flat if _is_packed(leaf))
        return leaves

    def _unpack_stashed(self, leaf, index: int):
        if not isinstance(leaf, _Packed):
            return leaf
        if leaf.version is not None and leaf.packed._version != leaf.version:
            raise inplace_error(
                leaf.packed.type(), leaf.packed.shape, leaf.packed._version, leaf.version,
                f"the output of expensive op {index} of region {self.name!r}",
            )
        # A fresh alias: autograd gives the replayed op's output its own history, which must not
        # land on the stashed tensor (the store's, or the forward's own output).
        return self._unpack_input(leaf.packed).detach()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectiveRun:
    """What one call of a recomputed region dropped and stashed (the regions' counters and profiles)."""

    dropped_bytes: int
    """Bytes of saved tensors dropped in forward, to be regenerated in backward."""
    stash_bytes: int
    """Bytes of expensive outputs handed to the outer hooks (0 for whole-region recompute)."""
    stashed_tensors: int
    """Tensors among them."""
    selective: bool
    """False where the region had to be recomputed whole (see the module docstring)."""


def selective_checkpoint(
    fn: Callable, args: tuple, kwargs: dict, name: str, *, selective: bool = True,
    on_recompute: Optional[Callable[[float], None]] = None,
) -> tuple[Any, SelectiveRun]:
    """Run ``fn(*args, **kwargs)`` as a recomputed region: selectively (expensive outputs stashed
    through the outer hooks, cheap ops re-run) or, with ``selective=False``, whole. Returns its
    output and what it dropped. ``on_recompute`` gets each re-run's wall time in ms (profiling)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs), SelectiveRun(dropped_bytes=0, stash_bytes=0, stashed_tensors=0, selective=False)
    frame_type = _SelectiveFrame if selective else _Frame
    frame = frame_type(fn, name, args, kwargs, on_recompute)
    out = frame.run()
    if isinstance(frame, _SelectiveFrame):
        run = SelectiveRun(
            dropped_bytes=frame.dropped_bytes, stash_bytes=frame.stash_bytes,
            stashed_tensors=len(frame._stashed_leaves()), selective=frame.splittable,
        )
    else:
        run = SelectiveRun(dropped_bytes=frame.dropped_bytes, stash_bytes=0, stashed_tensors=0, selective=False)
    return out, run
