"""Predict before renting the GPU: memory and step time of every policy, from the model alone.

``predict(model, *example_args, machine=...)`` runs one training step (forward, loss, backward;
no optimizer step) of a copy of ``model`` on the meta device: the copy's parameters and every
activation are meta tensors, shapes and dtypes without memory, so a 7B-class model predicts on a
laptop. The model's own parameters are never read, moved or copied.

    model ──copy, parameters as meta──▶ one step on meta, under three observers:
        region hooks       which region runs (the regions the engine would use: ``regions=``)
        saved-tensor hooks what each region saves, by the engine's rules (``_hooks.Eligibility``,
                           each storage counted once per step, as the store counts it), and for a
                           selective run what it drops and what it stashes (``_selective``'s split)
        dispatch mode      per op: FLOPs (``torch.utils.flop_counter``'s formulas), bytes touched,
                           and its roofline time on ``machine``:
                               max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + op cost
    ──▶ RegionProfile per region (bytes counted; times predicted) ──▶ the planner (``make_plan``)
        for the budget, and for every policy over a list of budgets ──▶ ``Prediction``

Backward ops are charged to the region whose saved tensor was unpacked last (autograd unpacks a
node's saves just before running it). On meta, ``scaled_dot_product_attention`` would take its
math path and save sequence² scores; with ``attention=Attention.FUSED`` (the default) it runs the
fused kernel the target would (flash attention; the CPU's own flash kernel on a CPU machine).

Memory a step needs on the device, for "does it fit": the parameters, their gradients and the
optimizer's state (``state_bytes_per_param``), plus the plan's predicted activation peak. The
temporaries of the op running at the peak are not counted. ``longest`` searches the longest
sequence that fits a device memory under each policy, from fake steps at a few lengths fitted by
``_fit`` (bytes linear in tokens, plus a tokens x sequence term where attention is not fused).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib.util
import math
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from ._config import DEFAULT_MIN_OFFLOAD_BYTES, Config
from ._cost import MB, MachineProfile, RegionProfile, Scope
from ._errors import OffloadError
from ._fit import ProfileFit, Shape
from ._hooks import Eligibility
from ._machines import Machine, from_probe, get_machine
from ._planner import MOVES_BYTES, Plan
from ._policy import AutoPolicy, make_plan
from ._probe import probe
from ._profiler import AFTER_NAME, BEFORE_NAME
from ._regions import RegionsArg, resolve_regions
from ._selective import MIN_SELECTIVE_MS, is_expensive
from ._session import Session

__all__ = [
    "BUDGET_FRACTIONS",
    "POLICIES",
    "Attention",
    "Longest",
    "WITHOUT_ENGINE",
    "Prediction",
    "PolicyPoint",
    "RegionCount",
    "held_bytes",
    "measure_machine",
    "predict",
    "write_plot",
]

POLICIES = ("none", "checkpoint", "offload", "recompute", "selective", "auto")
"""The policies a prediction compares. "checkpoint" is ``torch.utils.checkpoint`` on every region
without the engine: its inputs kept, one more forward in backward, which is what "recompute"
costs in this model too (the engine's recompute may stop early; the prediction does not count on it)."""
WITHOUT_ENGINE = ("none", "checkpoint")
"""The policies of ``POLICIES`` that run without the engine, so are priced without its host costs
(``MachineProfile.without_host_costs``): the model as it is, and ``torch.utils.checkpoint``."""
BUDGET_FRACTIONS = (1.0, 0.5, 0.25, 0.1)
"""The budgets of the policy table, as fractions of the activation peak without the engine."""

_MS_PER_S = 1e3
_GB = 1e9
_LONGEST_CAP = 1 << 20
"""The longest sequence ``longest`` tries, tokens."""
_FIT_LENGTHS = (4, 2, 1)
"""``longest`` fits over fake steps at the example's sequence divided by these."""

_SDPA_FOR_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
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


class Attention(enum.Enum):
    """How ``scaled_dot_product_attention`` runs in the fake step."""

    FUSED = "fused"
    """The fused kernel the target runs (flash; efficient attention with a mask): saves q, k, v,
    the output and the log-sum-exp, no sequence² scores."""
    AS_WRITTEN = "as-written"
    """Whatever the meta device does: the math path, scores and probabilities saved."""


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
            forward_dispatches=self.forward_dispatches,
            forward_ms=self.forward_ms,
            backward_ms=self.backward_ms,
            recompute_ms=self.forward_ms,
            cheap_bytes=self.cheap_bytes,
            expensive_bytes=self.expensive_bytes,
            expensive_tensors=self.expensive_tensors,
            selective_ms=max(MIN_SELECTIVE_MS, self.cheap_ms) if selective else 0.0,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyPoint:
    """One policy at one budget: the plan's predicted activation peak and step time."""

    policy: str
    budget_fraction: Optional[float]
    """The budget as a fraction of the peak without the engine; None: no budget."""
    budget_bytes: Optional[int]
    peak_bytes: int
    """The plan's predicted activation peak: what it needs on the device (``Plan.predicted_peak_bytes``)."""
    held_bytes: int
    """What the engine will hold at most carrying it out (``held_bytes``): more than ``peak_bytes``
    where the plan moves bytes, since the store prefetches into any room left under the budget."""
    step_ms: float
    fits: bool
    decisions: str
    """The plan's decisions, run-length coded: "keep x2, offload x6"."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Longest:
    """The longest sequence whose parameters, gradients, optimizer state, activation peak and working
    set fit the device memory under one policy (0: not even one token). Searched up to ``_LONGEST_CAP``."""

    policy: str
    sequence: int
    peak_bytes: int
    """The plan's predicted activation peak at that length."""
    working_bytes: int
    """The running region's own saves on top of it (``_working_bytes``)."""
    step_ms: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """What one training step of a model costs on a machine, predicted from a fake step."""

    machine: Machine
    regions: tuple[RegionCount, ...]
    """Before the regions, each region, after them (``Scope``)."""
    other_ms: float
    """Predicted time of the step outside the regions (embedding, head, loss; forward and backward)."""
    plan: Plan
    """The plan of ``policy`` at ``budget_mb``."""
    points: tuple[PolicyPoint, ...]
    """Every policy in ``POLICIES`` at every budget fraction."""
    parameter_bytes: int
    state_bytes: int
    """Gradients and optimizer state: what the step holds besides parameters and activations."""
    forward_flops: int
    backward_flops: int
    longest: tuple[Longest, ...] = ()
    longest_memory_bytes: int = 0
    assumed: tuple[str, ...] = ()
    """Where the model branched on a boolean tensor, taken as true (Note: [a branch on a meta bool
    is taken as true]): file:line of each read."""
    wall_s: float = 0.0
    """Seconds the prediction took (the fake step and the planning)."""

    @property
    def profiles(self) -> tuple[RegionProfile, ...]:
        return tuple(r.profile() for r in self.regions)

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameter_bytes + self.state_bytes

    def table(self) -> str:
        """The policy table: one row per policy and budget."""
        header = (
            f"{'policy':<11} {'budget':>8} {'budget MB':>11} {'peak MB':>11} {'held MB':>11} {'step ms':>11}  "
            f"{'fits':<4}  plan"
        )
        lines = [header, "-" * len(header)]
        for p in self.points:
            fraction = "-" if p.budget_fraction is None else f"{p.budget_fraction:.0%}"
            budget = "-" if p.budget_bytes is None else f"{p.budget_bytes / MB:,.1f}"
            lines.append(
                f"{p.policy:<11} {fraction:>8} {budget:>11} {p.peak_bytes / MB:>11,.1f} {p.held_bytes / MB:>11,.1f} "
                f"{p.step_ms:>11.2f}  "
                f"{'yes' if p.fits else 'NO':<4}  {p.decisions}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        m = self.machine
        lines = [
            f"prediction for {m.name}: {m.achieved_flops() / 1e12:,.2f} TFLOP/s, "
            f"{m.achieved_memory_gb_per_s():,.1f} GB/s memory, link {m.achieved_link_gb_per_s()[0]:,.2f} GB/s "
            f"({m.link}), all achieved",
            f"step: {self.forward_flops / 1e12:,.3f} TFLOP forward, {self.backward_flops / 1e12:,.3f} TFLOP backward; "
            f"parameters {self.parameter_bytes / MB:,.1f} MB, "
            f"gradients and optimizer state {self.state_bytes / MB:,.1f} MB",
            "",
            self.table(),
        ]
        if self.assumed:
            lines += ["", "branches on a boolean tensor taken as true: " + ", ".join(sorted(set(self.assumed)))]
        if self.longest:
            lines += ["", f"longest sequence within {self.longest_memory_bytes / _GB:,.1f} GB of device memory:"]
            lines += [
                f"  {x.policy:<11} {x.sequence:>9,}  (activations {x.peak_bytes / MB:,.0f} MB + "
                f"working set {x.working_bytes / MB:,.0f} MB, step {x.step_ms:,.1f} ms)"
                for x in self.longest
            ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {
            "machine": dataclasses.asdict(self.machine),
            "regions": [dataclasses.asdict(r) | {"scope": r.scope.value} for r in self.regions],
            "other_ms": self.other_ms,
            "plan": self.plan.to_dict(),
            "points": [dataclasses.asdict(p) for p in self.points],
            "parameter_bytes": self.parameter_bytes,
            "state_bytes": self.state_bytes,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "longest": [dataclasses.asdict(x) for x in self.longest],
            "longest_memory_bytes": self.longest_memory_bytes,
            "assumed": list(self.assumed),
            "wall_s": self.wall_s,
        }


# -- the fake step ---------------------------------------------------------------------------------


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta", requires_grad=t.requires_grad)


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes: the
    deep copy is handed them through its memo, so no parameter is ever read or copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(_meta_like(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = _meta_like(b)
    return copy.deepcopy(model, memo)


def _to_meta(value: Any) -> Any:
    return tree_map(lambda a: _meta_like(a) if isinstance(a, torch.Tensor) else a, value)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, or its storage where that is smaller
    (an expanded tensor)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _droppable(t: torch.Tensor) -> bool:
    """``_recompute._droppable``'s rule, for meta tensors too (which it leaves out: a real run
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


class _Step:
    """The counts of one fake step: per slot (0: before, 1..n: the regions, n+1: after)."""

    def __init__(self, names: Sequence[str], machine: Machine, eligible: Eligibility) -> None:
        self.machine = machine
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
        self.ms_per_byte = _MS_PER_S / (machine.achieved_memory_gb_per_s() * _GB)
        self.op_ms = machine.assumptions.op_overhead_us / _MS_PER_S

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
        if self.eligible(t):
            storage = t.untyped_storage()
            seen = self.seen.get(storage._cdata)
            if seen is None or seen() is None:
                self.seen[storage._cdata] = weakref.ref(t if t._base is None else t._base)
                count.saved_bytes += storage.nbytes()
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
        if func.is_view or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.lift_fresh):
            return  # aliases: no memory touched, no kernel
        packet = func.overloadpacket
        formula = flop_registry.get(packet)
        if formula is None and packet.__name__ in _FLOP_ALIASES:
            formula = flop_registry.get(getattr(torch.ops.aten, _FLOP_ALIASES[packet.__name__]))
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        touched = sum(_nbytes(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        ms = max(flops * self.flop_ms_per_flop, touched * self.ms_per_byte) + self.op_ms
        count = self.counts[self.slot()]
        if self.where.phase is _Phase.FORWARD:
            count.forward_flops += flops
            count.forward_bytes += touched
            count.forward_ms += ms
            count.forward_ops += 1
            if self.where.inside:
                if is_expensive(func):
                    self.expensive.append([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
                else:
                    count.cheap_ms += ms
        else:
            count.backward_flops += flops
            count.backward_bytes += touched
            count.backward_ms += ms
            count.backward_ops += 1


# Note: [a branch on a meta bool is taken as true]
#     A meta tensor has no values, so Python cannot branch on one: ``if mask.all():`` reads a
#     scalar (``aten._local_scalar_dense``) that does not exist. Hugging Face's models do so on every
#     step, to take their fast path when nothing is padded or packed (``find_packed_sequence_indices``,
#     ``_ignore_causal_mask_sdpa``): true for a training batch without padding, which is what a
#     prediction describes. So a read of a boolean is answered True, and where it happened is kept
#     (``Prediction.assumed``); a read of any other scalar (``.item()`` of a loss, a count) raises.
_ASSUMED_BOOL = True


def _caller() -> str:
    """file:line of the innermost frame outside torch and offload: who read the scalar."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/offload/" not in path:
            return f"{Path(path).name}:{frame.lineno} ({frame.name})"
    return "?"


class _Observe(TorchDispatchMode):
    """Counts every op (``_Step.op``); an op that cannot run on meta raises ``OffloadError`` naming it."""

    def __init__(self, step: _Step) -> None:
        super().__init__()
        self.step = step
        self.assumed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype is torch.bool:
            self.assumed.append(_caller())  # See Note: [a branch on a meta bool is taken as true]
            return _ASSUMED_BOOL
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            raise OffloadError(
                f"offload.predict: op {func} failed on the meta device, so this model cannot be predicted without "
                f"running it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Fix: where the op has "
                f"no meta kernel, give it one (torch.library.register_fake); where the model reads a tensor's value "
                f"(.item(), .tolist()), keep that read out of the step it predicts"
            ) from e
        self.step.op(func, args, kwargs, out)
        return out


class _FusedAttention(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` as the fused kernel the target would run."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._fused(*args, **kwargs)

    def _fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if enable_gqa and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
        if self.device_type == "cpu" and _SDPA_FOR_CPU is not None and dropout_p == 0.0:
            return _SDPA_FOR_CPU(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if self.device_type == "cuda" and attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale
            )[0]
        if self.device_type == "cuda":
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
            )[0]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )


def _loss(output: Any) -> torch.Tensor:
    """The step's loss: a scalar the output holds (``loss``, a (logits, loss) pair), else the sum of
    its first tensor that requires grad."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    scalars = [t for t in tensors if t.dim() == 0]
    if scalars:
        return scalars[0]
    if tensors:
        return tensors[0].sum()
    raise OffloadError(
        f"offload.predict: the model's output ({type(output).__name__}) holds no tensor that requires grad, so "
        "there is no backward to predict; pass example inputs that produce a loss (e.g. labels) or loss_fn="
    )


@dataclasses.dataclass(frozen=True)
class _Run:
    counts: tuple[RegionCount, ...]
    parameter_bytes: int
    assumed: tuple[str, ...]


def _fake_step(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    machine: Machine,
    regions: RegionsArg,
    attention: Attention,
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    min_offload_bytes: int,
) -> _Run:
    fake = _meta_copy(model)
    fake.train(model.training)
    listed = isinstance(regions, (torch.nn.ModuleList, torch.nn.Sequential)) or not (
        isinstance(regions, (str, torch.nn.Module)) or callable(regions)
    )
    if listed:  # the model's own modules: the copy's of the same names
        names = {id(m): name for name, m in model.named_modules()}
        chosen = list(regions)  # type: ignore[arg-type]  # an iterable of modules, by the test above
        missing = [type(m).__name__ for m in chosen if id(m) not in names]
        if missing:
            raise ValueError(
                f"regions= lists modules that are not in the model ({', '.join(missing)}); pass modules of the "
                "model being predicted, e.g. regions=model.blocks, or regions='auto'"
            )
        regions = [fake.get_submodule(names[id(m)]) for m in chosen]
    found = resolve_regions(regions, fake)
    eligible = Eligibility(torch.device("meta"), min_offload_bytes)
    eligible.skip_modules([fake])
    step = _Step([name for name, _ in found.regions], machine, eligible)
    handles = []
    for index, (_, module) in enumerate(found.regions):
        handles.append(
            module.register_forward_pre_hook(lambda m, a, kw, i=index: step.region_starts(i, a, kw), with_kwargs=True)
        )
        handles.append(module.register_forward_hook(lambda m, a, out, i=index: step.region_ends(i)))
    meta_args, meta_kwargs = _to_meta(args), _to_meta(kwargs)
    observe = _Observe(step)
    modes: list[Any] = [observe]
    if attention is Attention.FUSED:
        modes.insert(0, _FusedAttention(machine.device_type))
    try:
        with torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack):
            for mode in modes:
                mode.__enter__()
            try:
                output = fake(*meta_args, **meta_kwargs)
                loss = loss_fn(output) if loss_fn is not None else _loss(output)
                step.backward_starts()
                loss.backward()
            finally:
                for mode in reversed(modes):
                    mode.__exit__(None, None, None)
    finally:
        for handle in handles:
            handle.remove()
    parameter_bytes = sum(p.numel() * p.element_size() for p in fake.parameters())
    return _Run(tuple(step.counts), parameter_bytes, tuple(observe.assumed))


# -- planning --------------------------------------------------------------------------------------


def _decisions(plan: Plan) -> str:
    """How many regions take each decision: "keep x6, offload x26"."""
    counts: dict[str, int] = {}
    for d in plan.decisions:
        counts[d.value] = counts.get(d.value, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def _plan(
    profiles: Sequence[RegionProfile],
    link: MachineProfile,
    policy: str,
    budget: Optional[int],
    other_ms: float,
    *,
    quick: bool = False,
) -> Plan:
    """The plan of ``policy`` ("checkpoint" is "recompute"; "none" takes no budget; those of
    ``WITHOUT_ENGINE`` priced without the engine's host costs). ``quick``:
    "auto" without its local search (``max_search_moves=0``), which fits whenever the full search
    does (it starts from the same fixed plans, all-offload and all-recompute among them): what a
    search over lengths asks."""
    engine_policy: Union[str, AutoPolicy] = "recompute" if policy == "checkpoint" else policy
    if policy in WITHOUT_ENGINE:
        link = link.without_host_costs()
    if quick and policy == "auto":
        engine_policy = AutoPolicy(max_search_moves=0)
    if engine_policy in ("none", "recompute", "selective"):
        plan = make_plan(profiles, link, None, engine_policy, other_ms=other_ms)
        fits = budget is None or plan.predicted_peak_bytes <= budget
        return dataclasses.replace(plan, policy=policy, budget_bytes=budget, fits_budget=fits)
    return dataclasses.replace(make_plan(profiles, link, budget, engine_policy, other_ms=other_ms), policy=policy)


def held_bytes(plan: Plan, keep_peak_bytes: int) -> int:
    """The most the engine holds carrying ``plan`` out: its predicted peak, or where it moves bytes
    over the link and has a budget, up to that budget (the store prefetches moved entries back into
    the room left under it, and holds no more than the step saves: ``keep_peak_bytes``)."""
    moves = any(r.decision in MOVES_BYTES for r in (*plan.regions, *plan.outside))
    if not moves or plan.budget_bytes is None:
        return plan.predicted_peak_bytes
    return max(plan.predicted_peak_bytes, min(plan.budget_bytes, keep_peak_bytes))


def _points(
    profiles: Sequence[RegionProfile], link: MachineProfile, other_ms: float, fractions: Sequence[float]
) -> tuple[PolicyPoint, ...]:
    keep_peak = make_plan(profiles, link, None, "none", other_ms=other_ms).predicted_peak_bytes
    points = []
    for policy in POLICIES:
        for fraction in fractions:
            budget = int(keep_peak * fraction)
            plan = _plan(profiles, link, policy, budget, other_ms)
            points.append(
                PolicyPoint(
                    policy=policy,
                    budget_fraction=fraction,
                    budget_bytes=budget,
                    peak_bytes=plan.predicted_peak_bytes,
                    held_bytes=held_bytes(plan, keep_peak),
                    step_ms=plan.predicted_step_ms,
                    fits=plan.fits_budget,
                    decisions=_decisions(plan),
                )
            )
    return tuple(points)


def _machine(machine: Union[str, Machine, MachineProfile]) -> Machine:
    if isinstance(machine, Machine):
        return machine
    if isinstance(machine, str):
        return get_machine(machine)
    if isinstance(machine, MachineProfile):
        return measure_machine(machine)
    raise TypeError(
        f"machine= takes a machine name, an offload._machines.Machine or offload.probe()'s MachineProfile, "
        f"got {type(machine).__name__}"
    )


def _check_fractions(budgets: Sequence[float]) -> tuple[float, ...]:
    fractions = tuple(budgets)
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and f >= 0):
            raise ValueError(f"budgets= are fractions of the peak without the engine (1.0 = 100 %), got {f!r}")
    return fractions


def predict(
    model: torch.nn.Module,
    *example_args: Any,
    machine: Union[str, Machine, MachineProfile] = "h100-sxm",
    budget_mb: Optional[float] = None,
    policy: str = "auto",
    regions: RegionsArg = "auto",
    example_kwargs: Optional[dict] = None,
    budgets: Sequence[float] = BUDGET_FRACTIONS,
    attention: Attention = Attention.FUSED,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    state_bytes_per_param: Optional[float] = None,
    longest_in: Optional[Callable[[int], tuple[tuple, dict]]] = None,
    memory_bytes: Optional[int] = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
) -> Prediction:
    """Predict one training step of ``model(*example_args, **example_kwargs)`` on ``machine``.

    ``machine``: a name (``offload._machines.machine_names()``), a ``Machine``, or
    ``offload.probe()`` for this machine (its compute is then measured: ``measure_machine``).
    ``budget_mb`` and ``policy`` choose ``Prediction.plan``; ``budgets`` are the fractions of the
    peak without the engine at which every policy in ``POLICIES`` is tabled. ``regions`` as for
    ``offload.engine`` (modules of ``model`` are mapped onto its copy). ``state_bytes_per_param``:
    gradient and optimizer bytes per parameter (default: a gradient and Adam's two moments in the
    parameter's dtype, 3 x its size). ``longest_in(seq) -> (args, kwargs)``: inputs at another
    sequence length; with it, the longest sequence fitting ``memory_bytes`` (default: the
    machine's) under each policy is searched. Raises ``OffloadError`` for an op that cannot run on
    meta tensors, naming it.
    """
    start = time.perf_counter()
    target = _machine(machine)
    fractions = _check_fractions(budgets)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; predict compares: {', '.join(POLICIES)}")
    if not isinstance(attention, Attention):
        raise TypeError(f"attention= takes an offload._predict.Attention, got {attention!r}")
    kwargs = dict(example_kwargs or {})
    run = _fake_step(model, example_args, kwargs, target, regions, attention, loss_fn, min_offload_bytes)
    dtype_bytes = run.parameter_bytes / max(1, sum(p.numel() for p in model.parameters()))
    per_param = 3 * dtype_bytes if state_bytes_per_param is None else float(state_bytes_per_param)
    state_bytes = int(sum(p.numel() for p in model.parameters()) * per_param)
    counts = run.counts
    profiles = tuple(c.profile() for c in counts)
    other_ms = sum(c.forward_ms + c.backward_ms for c in counts if c.scope is not Scope.REGION)
    link = target.machine_profile()
    budget = None if budget_mb is None else int(budget_mb * MB)
    plan = _plan(profiles, link, policy, budget, other_ms)
    longest: tuple[Longest, ...] = ()
    memory = target.memory_bytes if memory_bytes is None else int(memory_bytes)
    if longest_in is not None:
        base_seq = next((c.input_dims[-2] for c in counts if c.scope is Scope.REGION and len(c.input_dims) >= 3), 2)
        longest = _longest(
            model,
            longest_in,
            base_seq,
            target,
            regions,
            attention,
            loss_fn,
            min_offload_bytes,
            memory - (run.parameter_bytes + state_bytes),
        )
    return Prediction(
        machine=target,
        regions=counts,
        other_ms=other_ms,
        plan=plan,
        points=_points(profiles, link, other_ms, fractions),
        parameter_bytes=run.parameter_bytes,
        state_bytes=state_bytes,
        forward_flops=sum(c.forward_flops for c in counts),
        backward_flops=sum(c.backward_flops for c in counts),
        longest=longest,
        longest_memory_bytes=memory if longest_in is not None else 0,
        assumed=run.assumed,
        wall_s=time.perf_counter() - start,
    )


def _longest(
    model: torch.nn.Module,
    inputs_at: Callable[[int], tuple[tuple, dict]],
    base_seq: int,
    machine: Machine,
    regions: RegionsArg,
    attention: Attention,
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    min_offload_bytes: int,
    free_bytes: int,
) -> tuple[Longest, ...]:
    """Per policy, the longest sequence whose predicted activation peak plus working set fits
    ``free_bytes`` (device memory less parameters, gradients and optimizer state), searched over
    profiles fitted (``_fit``) to fake steps at ``base_seq`` and fractions of it."""
    fit: Optional[ProfileFit] = None
    dims: tuple[int, ...] = ()
    for divisor in _FIT_LENGTHS:
        args, kwargs = inputs_at(max(2, base_seq // divisor))
        run = _fake_step(model, args, kwargs, machine, regions, attention, loss_fn, min_offload_bytes)
        dims = next((c.input_dims for c in run.counts if c.scope is Scope.REGION and len(c.input_dims) >= 3), ())
        if not dims:
            raise ValueError(
                "longest_in=: the regions' first input is not (batch, sequence, width), so its sequence cannot be "
                "varied; pass regions whose first input is"
            )
        if fit is None:
            fit = ProfileFit([c.name for c in run.counts])
        shape = Shape.of(dims)
        fit.add(shape, [c.profile() for c in run.counts])
        fit.add_other(shape, sum(c.forward_ms + c.backward_ms for c in run.counts if c.scope is not Scope.REGION))
    assert fit is not None  # _FIT_LENGTHS is not empty
    link = machine.machine_profile()

    def plan_at(policy: str, seq: int, quick: bool) -> tuple[Plan, int]:
        profiles, other_ms = fit.derive(Shape.of((*dims[:-2], seq, dims[-1])))
        working = _working_bytes(profiles)
        return _plan(profiles, link, policy, max(0, free_bytes - working), other_ms, quick=quick), working

    def fits(policy: str, seq: int) -> bool:
        plan, working = plan_at(policy, seq, quick=True)
        return working <= free_bytes and plan.fits_budget

    results = []
    for policy in POLICIES:
        low, high = 0, 1
        while high <= _LONGEST_CAP and fits(policy, high):
            low, high = high, high * 2
        high = min(high, _LONGEST_CAP + 1)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(policy, middle) else (low, middle)
        plan, working = plan_at(policy, max(1, low), quick=False)
        results.append(
            Longest(
                policy=policy,
                sequence=low,
                peak_bytes=plan.predicted_peak_bytes,
                working_bytes=working,
                step_ms=plan.predicted_step_ms,
            )
        )
    return tuple(results)


def _working_bytes(profiles: Sequence[RegionProfile]) -> int:
    """The running region's own saves, which the planner's peak leaves out (they exist with or
    without the engine): the most any region, or the step after the regions, saves."""
    return max((p.saved_bytes for p in profiles), default=0)


# -- this machine, measured ------------------------------------------------------------------------

_MATMUL_SIZE = 1024
_COPY_BYTES = 64 * MB
_TINY_OPS = 2000
_HELD_TENSORS = 1000
"""Saves in the chain that measures the engine's cost per saved tensor (each of
``DEFAULT_MIN_OFFLOAD_BYTES``, the least the store takes)."""
_REPEATS = 5


class _CountOps(TorchDispatchMode):
    """Counts the ops dispatched: ``ops`` those ``_Step.op`` charges a fixed cost for, ``dispatches``
    all of them (what a dispatch mode pays on)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.dispatches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.dispatches += 1
        if not func.is_view and func.overloadpacket not in (torch.ops.aten.detach, torch.ops.aten.lift_fresh):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: the floor of what ``_selective``'s modes pay per op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _best_s(fn: Callable[[], Any]) -> float:
    """Seconds of the least disturbed of ``_REPEATS`` runs of ``fn`` after one warm-up (noise only adds)."""
    fn()
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _held_tensor_overhead_us() -> float:
    """The engine's host cost per saved tensor it keeps, us: a chain of ``_HELD_TENSORS`` saves run
    forward and backward under the engine at budget None (its ``Session``, hooks and store, as
    ``offload.engine(None)`` installs them) against the same chain without it."""
    x = torch.ones(DEFAULT_MIN_OFFLOAD_BYTES // 4, requires_grad=True)
    session = Session(Config.from_user(None, device=torch.device("cpu")))

    def chain(engine: bool) -> None:
        if engine:
            session.enter()
        try:
            y = x
            for _ in range(_HELD_TENSORS):
                y = y.sin()  # saves its input: one pack in forward, one unpack in backward
            loss = y.sum()
        finally:
            if engine:
                session.exit(None, None, None)
        loss.backward()

    try:
        with_s, without_s = _best_s(lambda: chain(True)), _best_s(lambda: chain(False))
    finally:
        if session.store is not None:
            session.store.close()
    return max(0.0, (with_s - without_s) / _HELD_TENSORS * 1e6)


def _dispatch_overhead_us() -> float:
    """Host cost of one op under a Python dispatch mode, us: a forward of ``_TINY_OPS`` one-element
    ops under autograd inside ``_PassThrough`` against the same without it, over the ops it dispatched."""
    tiny = torch.ones(1, requires_grad=True)

    def forward() -> None:
        y = tiny
        for _ in range(_TINY_OPS):
            y = y * 1.0

    def under_mode() -> None:
        with _PassThrough():
            forward()

    counter = _CountOps()
    with counter:
        forward()
    return max(0.0, (_best_s(under_mode) - _best_s(forward)) / max(1, counter.dispatches) * 1e6)


def measure_machine(profile: Optional[MachineProfile] = None, *, dtype: torch.dtype = torch.float32) -> Machine:
    """This CPU as a ``Machine``: ``profile`` (default ``offload.probe("cpu")``) for the link and
    per-tensor cost; a timed ``_MATMUL_SIZE``² matmul in ``dtype``, a timed 64 MiB copy, and for
    the cost of one op a chain of ``_TINY_OPS`` one-element ops run forward and backward under
    autograd, over the ops it dispatched (a training step's op pays autograd's bookkeeping too;
    best of ``_REPEATS``); the engine's host costs per saved tensor (``_held_tensor_overhead_us``)
    and per op under a dispatch mode (``_dispatch_overhead_us``). CUDA machines are measured on
    CUDA by the probe's link only: use a named machine for their compute."""
    profile = probe("cpu") if profile is None else profile
    if profile.device_type != "cpu":
        raise ValueError(
            f"measure_machine measures this CPU; the profile is of {profile.device_type!r}: pass a named machine "
            "for a GPU's compute"
        )
    import psutil  # a dependency of the package; imported here to keep import offload light

    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE, dtype=dtype)
    src = torch.empty(_COPY_BYTES // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    tiny = torch.ones(1, requires_grad=True)

    def chain() -> None:  # a training step's worth of tiny ops: under autograd, forward and backward
        y = tiny
        for _ in range(_TINY_OPS):
            y = y * 1.0
        y.backward()

    counter = _CountOps()
    with counter:
        chain()

    matmul_s = _best_s(lambda: a @ a)
    copy_s = _best_s(lambda: dst.copy_(src))
    tiny_s = _best_s(chain)
    return from_probe(
        profile,
        flops=2 * _MATMUL_SIZE**3 / matmul_s,
        memory_gb_per_s=2 * _COPY_BYTES / copy_s / _GB,
        memory_bytes=int(psutil.virtual_memory().total),
        op_overhead_us=tiny_s / max(1, counter.ops) * 1e6,
        held_tensor_overhead_us=_held_tensor_overhead_us(),
        dispatch_overhead_us=_dispatch_overhead_us(),
    )


def write_plot(prediction: Prediction, path: Union[str, Path]) -> Optional[Path]:
    """Step time against activation peak of every policy point, Pareto front marked, as a PNG at
    ``path``; None where matplotlib is not installed (it is optional)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in POLICIES:
        points = [p for p in prediction.points if p.policy == policy]
        ax.scatter([p.peak_bytes / MB for p in points], [p.step_ms for p in points], label=policy)
    ordered = sorted(prediction.points, key=lambda p: (p.peak_bytes, p.step_ms))
    front, best = [], math.inf
    for p in ordered:
        if p.step_ms < best:
            front.append(p)
            best = p.step_ms
    ax.plot([p.peak_bytes / MB for p in front], [p.step_ms for p in front], "k--", linewidth=0.8, label="Pareto front")
    ax.set_xlabel("predicted activation peak, MB")
    ax.set_ylabel("predicted step, ms")
    ax.set_title(f"offload.predict on {prediction.machine.name}")
    ax.legend(fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
