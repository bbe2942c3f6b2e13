"""What one fake step costs, counted per region: saved bytes, FLOPs, bytes touched, predicted time.

``StepCounter`` is told what happens in a step run on meta tensors (``fake_step`` runs it and
wires the observers to it) and keeps one ``RegionCount`` per slot: before the regions, each
region, after them. It reads no clock; every time it keeps is a roofline on ``machine``.

    region hooks        region_starts / region_ends: which region runs, its inputs
    saved-tensor hooks  pack: what it saves, by the engine's rules (``_memory.hooks.Eligibility``, each
                        storage counted once per step, as the store counts it), and for a selective
                        run what it drops and what it stashes (``_regions.selective``'s split);
                        unpack: which region the backward is in
    dispatch mode       op: FLOPs (``torch.utils.flop_counter``'s formulas), bytes touched, time
                            max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + op cost
                            (a fused attention kernel at its own achieved FLOP/s);
                            the storages it creates (``transient``: the step's transients)

Backward ops are charged to the region whose saved tensor was unpacked last (autograd unpacks a
node's saves just before running it).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._cost import RegionProfile, Scope
from .._memory.hooks import Eligibility
from .._plan.profiler import AFTER_NAME, BEFORE_NAME
from .._regions.selective import MIN_SELECTIVE_MS, flop_formula
from .machines import Machine
from .selective_rule import BUILT_IN, SelectiveRule, is_matmul
from .transient import LiveBytes

__all__ = ["FUSED_ATTENTION", "RegionCount", "StepCounter", "is_alias"]

_MS_PER_S = 1e3
_GB = 1e9


FUSED_ATTENTION = frozenset(
    (
        torch.ops.aten._scaled_dot_product_flash_attention,
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
        torch.ops.aten._scaled_dot_product_efficient_attention,
        torch.ops.aten._scaled_dot_product_efficient_attention_backward,
        torch.ops.aten._scaled_dot_product_cudnn_attention,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
    )
)
"""SDPA's fused kernels, forward and backward: charged at ``Machine.achieved_attention_flops``."""


def _causal_share(func: Any, args: tuple, kwargs: dict) -> float:
    """Of the FLOPs ``torch.utils.flop_counter`` counts for a fused attention call, the share its
    kernel computes: 1/2 where the call is causal over as many keys as queries (the kernel skips the
    masked blocks; the formulas ignore ``is_causal``, and FlashAttention's published utilization
    counts a causal call's FLOPs halved), else 1."""
    names = [a.name for a in func._schema.arguments]
    if "is_causal" not in names:
        return 1.0

    def arg(name: str) -> Any:
        i = names.index(name)
        return kwargs[name] if name in kwargs else args[i] if i < len(args) else None

    query, key = arg("query"), arg("key")
    return 0.5 if arg("is_causal") and query.shape[-2] == key.shape[-2] else 1.0


def is_alias(func: Any) -> bool:
    """Whether an op only aliases (a view, a detach): no memory touched, no kernel, so no op cost
    charged. ``this_cpu`` counts the ops of its timed chain by the same rule, so the cost
    it measures per op is the cost charged here per op."""
    return func.is_view or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.lift_fresh)


class _Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclasses.dataclass
class RegionCount:
    """What one region (or the saves outside the regions) did in the fake step, counted."""

    name: str
    scope: Scope = Scope.REGION
    saved_bytes: int = 0
    """Bytes of distinct storages the engine would take (``Eligibility``), once per step."""
    num_tensors: int = 0
    largest_tensor_bytes: int = 0
    """Bytes of the largest storage among them (what the budget's room holds whole)."""
    input_bytes: int = 0
    cheap_bytes: int = 0
    """Of its droppable saves, the bytes a selective run drops (not inputs, not expensive outputs)."""
    expensive_bytes: int = 0
    """Bytes of outputs of expensive ops (matmul, attention, convolution) a selective run stashes."""
    expensive_tensors: int = 0
    forward_flops: int = 0
    backward_flops: int = 0
    forward_bytes: int = 0
    """Bytes the forward's ops read and wrote (views aside)."""
    backward_bytes: int = 0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    cheap_ms: float = 0.0
    """Predicted time of its forward's cheap ops: what a selective re-run costs."""
    forward_ops: int = 0
    backward_ops: int = 0
    forward_dispatches: int = 0
    """Ops its forward dispatched, views and detaches included (what a dispatch mode pays on)."""
    input_dims: tuple[int, ...] = ()
    """Shape of its first tensor input (for fitting over shapes)."""

    def profile(self) -> RegionProfile:
        """The planner's view: sizes as counted, times as predicted."""
        if self.scope is not Scope.REGION:
            return RegionProfile(
                name=self.name, scope=self.scope, saved_bytes=self.saved_bytes, num_tensors=self.num_tensors
            )
        selective = self.expensive_tensors > 0 or self.cheap_bytes > 0
        return RegionProfile(
            name=self.name,
            saved_bytes=self.saved_bytes,
            input_bytes=self.input_bytes,
            num_tensors=self.num_tensors,
            largest_tensor_bytes=self.largest_tensor_bytes,
            forward_dispatches=self.forward_dispatches,
            forward_ms=self.forward_ms,
            backward_ms=self.backward_ms,
            recompute_ms=self.forward_ms,
            cheap_bytes=self.cheap_bytes,
            expensive_bytes=self.expensive_bytes,
            expensive_tensors=self.expensive_tensors,
            selective_ms=max(MIN_SELECTIVE_MS, self.cheap_ms) if selective else 0.0,
        )


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, or its storage where that is smaller
    (an expanded tensor)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _droppable(t: torch.Tensor) -> bool:
    """``_regions.recompute.droppable``'s rule, for meta tensors too (which it leaves out: a real run
    never drops them)."""
    base = t if t._base is None else t._base
    if type(t) is not torch.Tensor or type(base) is not torch.Tensor:
        return False
    return not (base.requires_grad and base.is_leaf) and t.layout is torch.strided


@dataclasses.dataclass
class _Where:
    """Which region runs, in which phase: ``index`` -1 before the first, ``len(regions)`` after
    the last; between two regions it is the one that ended last, counted as before."""

    phase: _Phase = _Phase.FORWARD
    index: int = -1
    inside: bool = False


class _Packed:
    __slots__ = ("index", "tensor")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor


class StepCounter:
    """The counts of one fake step: per slot (0: before, 1..n: the regions, n+1: after)."""

    def __init__(
        self, names: Sequence[str], machine: Machine, eligible: Eligibility, rule: SelectiveRule = BUILT_IN
    ) -> None:
        self.machine = machine
        self.rule = rule
        self.matmuls = 0  # the running region's forward matmuls so far
        self.eligible = eligible
        self.counts = [RegionCount(BEFORE_NAME, Scope.BEFORE)]
        self.counts += [RegionCount(name) for name in names]
        self.counts.append(RegionCount(AFTER_NAME, Scope.AFTER))
        self.where = _Where()
        self.seen: dict[
            int, Any
        ] = {}  # storage -> weak reference to a tensor on it (See Note: [sizes a recompute trial counts])
        self.inputs: set[int] = set()  # the running region's input storages
        self.expensive: list[list[torch.Tensor]] = []  # the running region's expensive calls' outputs
        self.reached = 0  # expensive calls made before its latest save
        self.dropped: dict[int, int] = {}  # its droppable saves: storage -> bytes
        self.flop_ms_per_flop = _MS_PER_S / machine.achieved_flops()
        self.attention_ms_per_flop = _MS_PER_S / machine.achieved_attention_flops()
        self.ms_per_byte = _MS_PER_S / (machine.achieved_memory_gb_per_s() * _GB)
        self.op_ms = machine.assumptions.op_overhead_us / _MS_PER_S
        self.live = LiveBytes()

    def slot(self) -> int:
        w = self.where
        if w.phase is _Phase.FORWARD:
            if w.inside:
                return w.index + 1
            return len(self.counts) - 1 if w.index == len(self.counts) - 3 else 0
        return w.index

    # region hooks
    def region_starts(self, index: int, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        count = self.counts[index + 1]
        count.input_bytes = sum(
            a.untyped_storage().nbytes() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)
        )
        count.input_dims = tuple(tensors[0].shape) if tensors else ()
        self.inputs = {a.untyped_storage()._cdata for a in tensors}
        self.expensive, self.reached, self.dropped = [], 0, {}
        self.matmuls = 0
        self.where = _Where(_Phase.FORWARD, index, inside=True)

    def region_ends(self, index: int) -> None:
        count = self.counts[index + 1]
        calls = self.expensive[: self.reached]
        stash = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for call in calls for t in call}
        count.expensive_bytes = sum(stash.values())
        count.expensive_tensors = sum(len(call) for call in calls)
        count.cheap_bytes = sum(n for key, n in self.dropped.items() if key not in self.inputs and key not in stash)
        self.expensive, self.dropped = [], {}
        self.where = _Where(_Phase.FORWARD, index, inside=False)

    # saved-tensor hooks
    def pack(self, t: torch.Tensor) -> _Packed:
        slot = self.slot()
        count = self.counts[slot]
        self.live.saved(t)
        if self.eligible(t):
            storage = t.untyped_storage()
            seen = self.seen.get(storage._cdata)
            if seen is None or seen() is None:
                self.seen[storage._cdata] = weakref.ref(t if t._base is None else t._base)
                nbytes = storage.nbytes()
                count.saved_bytes += nbytes
                count.largest_tensor_bytes = max(count.largest_tensor_bytes, nbytes)
            count.num_tensors += 1
        if self.where.inside:
            self.reached = len(self.expensive)
            if _droppable(t):
                self.dropped[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return _Packed(slot, t)

    def unpack(self, packed: _Packed) -> torch.Tensor:
        self.where = _Where(_Phase.BACKWARD, packed.index)
        return packed.tensor

    def backward_starts(self) -> None:
        self.where = _Where(_Phase.BACKWARD, len(self.counts) - 1)

    # dispatch mode
    def op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self.where.phase is _Phase.FORWARD:
            self.counts[self.slot()].forward_dispatches += 1
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.live.created(t, new_storage=t.untyped_storage()._cdata not in inputs)
        if is_alias(func):
            return
        formula = flop_formula(func)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        fused_attention = func.overloadpacket in FUSED_ATTENTION
        if fused_attention:
            flops = int(flops * _causal_share(func, args, kwargs))
        touched = sum(_nbytes(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        per_flop = self.attention_ms_per_flop if fused_attention else self.flop_ms_per_flop
        ms = max(flops * per_flop, touched * self.ms_per_byte) + self.op_ms
        count = self.counts[self.slot()]
        if self.where.phase is _Phase.FORWARD:
            count.forward_flops += flops
            count.forward_bytes += touched
            count.forward_ms += ms
            count.forward_ops += 1
            if self.where.inside:
                self.matmuls += is_matmul(func)
                if self.rule.saves(func, self.matmuls if is_matmul(func) else 0):
                    self.expensive.append([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
                else:
                    count.cheap_ms += ms
        else:
            count.backward_flops += flops
            count.backward_bytes += touched
            count.backward_ms += ms
            count.backward_ops += 1
