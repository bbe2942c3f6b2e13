"""One training step of a model on the meta device: a copy with meta parameters, run under observers.

``fake_step`` copies the model with its parameters and buffers as meta tensors (shapes and dtypes
without memory: the model's own parameters are never read, moved or copied), runs forward, loss
and backward (no optimizer step) on meta inputs, and hands what happens to a
``count.StepCounter``:

    copy, parameters as meta ──▶ forward, loss, backward on meta, observed by
        region hooks        which region runs (the regions the engine would use: ``regions=``)
        saved-tensor hooks  what each region saves
        ``_Observe``        every op (a dispatch mode); one that cannot run on meta raises
                            ``OffloadError`` naming it
    ──▶ ``StepRun``: a ``RegionCount`` per slot, the parameter bytes, the branches assumed

On meta, some ops take another path than the target device would, and save other tensors:

    scaled_dot_product_attention  the math path, sequence² scores saved; with
                                  ``attention=Attention.FUSED`` (the default) the fused kernel the
                                  target runs instead (flash attention; the CPU's own flash kernel on
                                  a CPU machine), grouped-query k and v passed as they are, as flash
                                  takes them on CUDA (no expansion to every query head)
    dropout                       bernoulli_ then mul, the noise saved in the activation's dtype; on
                                  a CUDA target ``native_dropout`` instead, as CUDA runs it: a 1-byte
                                  bool mask saved (Note: [what the target's dropout saves])
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import os
import sysconfig
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .._errors import OffloadError
from .._memory.hooks import Eligibility
from .._regions.regions import RegionsArg, resolve_regions
from .count import RegionCount, StepCounter
from .machines import Machine
from .selective_rule import BUILT_IN, SelectiveRule

__all__ = ["Attention", "StepRun", "fake_step"]

_SDPA_FOR_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class Attention(enum.Enum):
    """How ``scaled_dot_product_attention`` runs in the fake step (``predict(attention=...)`` takes
    the member or its value, ``"fused"`` or ``"as-written"``)."""

    FUSED = "fused"
    """The fused kernel the target runs (flash; efficient attention with a mask): saves q, k, v,
    the output and the log-sum-exp, no sequence² scores."""
    AS_WRITTEN = "as-written"
    """Whatever the meta device does: the math path, scores and probabilities saved (what a model
    whose config asks for ``"eager"`` attention saves, as it never calls SDPA)."""

    @classmethod
    def of(cls, value: Attention | str) -> Attention:
        """``value`` as a member; a ``ValueError`` names the choices where it is none of them."""
        if isinstance(value, Attention):
            return value
        for member in cls:
            if value == member.value:
                return member
        raise ValueError(
            f"attention={value!r}; valid choices are {', '.join(repr(m.value) for m in cls)} "
            "(or offload._predict.predict.Attention): 'fused' for SDPA as the target's flash kernel, 'as-written' for "
            "what the model's own code saves"
        )


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


# Note: [a branch on a meta bool is taken as true]
#     A meta tensor has no values, so Python cannot branch on one: ``if mask.all():`` reads a
#     scalar (``aten._local_scalar_dense``) that does not exist. Hugging Face's models do so on every
#     step, to take their fast path when nothing is padded or packed (``find_packed_sequence_indices``,
#     ``_ignore_causal_mask_sdpa``): true for a training batch without padding, which is what a
#     prediction describes. So a read of a boolean is answered True, and where it happened is kept
#     (``Prediction.assumed``); a read of any other scalar (``.item()`` of a loss, a count) raises.
_ASSUMED_BOOL = True


_NOT_THE_MODEL = (
    os.path.dirname(os.path.abspath(torch.__file__ or "torch")) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)
"""Frames in these directories are never the model's: torch's and this package's."""
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_PACKAGES = ("site-packages", "dist-packages")


def _caller() -> str:
    """file:line of the innermost frame outside torch, offload and the standard library: the
    model's line that read the scalar. Frames are told apart by the directory of their module
    (a model kept under a directory named "offload" or "torch" is still the model's), and frozen
    modules (``<frozen runpy>``) are the interpreter's."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith("<"):
            continue
        path = os.path.abspath(frame.filename)
        stdlib = path.startswith(_STDLIB) and not any(name in path for name in _PACKAGES)
        if path.startswith(_NOT_THE_MODEL) or stdlib:
            continue
        return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


class _Observe(TorchDispatchMode):
    """Counts every op (``StepCounter.op``); an op that cannot run on meta raises ``OffloadError`` naming it."""

    def __init__(self, step: StepCounter) -> None:
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


# Note: [what the target's dropout saves]
#     ``F.dropout`` is composite where no fused kernel applies: on meta (and on a CPU) it draws the
#     noise with ``bernoulli_``, scales it, and ``mul`` saves it for backward in the activation's
#     dtype. CUDA runs ``native_dropout`` instead (``at::dropout`` takes it for a CUDA input with
#     0 < p < 1), which saves a bool mask, one byte an element. For a CUDA target the fake step calls
#     ``native_dropout`` itself, so what it counts is what the GPU saves.


class _AsTarget(TorchFunctionMode):
    """Runs the ops that take another path on meta than on the target as the target would:
    ``F.scaled_dot_product_attention`` as its fused kernel (``fused``), ``F.dropout`` as CUDA's
    ``native_dropout`` on a CUDA target."""

    def __init__(self, device_type: str, fused: bool) -> None:
        super().__init__()
        self.device_type = device_type
        self.fused = fused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.fused:
            return self._fused(*args, **kwargs)
        if func is F.dropout and self.device_type == "cuda":
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not (training and 0.0 < p < 1.0) or inplace:
            return F.dropout(x, p, training, inplace)
        return torch.ops.aten.native_dropout(x, p, True)[0]  # See Note: [what the target's dropout saves]

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
        # the flash kernels take grouped-query k and v with fewer heads as they are, and save them so
        if self.device_type == "cuda" and attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale
            )[0]
        if self.device_type == "cpu" and _SDPA_FOR_CPU is not None and dropout_p == 0.0:
            return _SDPA_FOR_CPU(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if enable_gqa and k.size(-3) != q.size(-3):  # the others take every query head's k and v
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
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
class StepRun:
    """What one fake step counted."""

    counts: tuple[RegionCount, ...]
    parameter_bytes: int
    assumed: tuple[str, ...]
    """file:line of each branch on a boolean tensor, taken as true."""
    transient_bytes: int = 0
    """The most bytes the step held at once besides its saves and the parameters' gradients
    (``transient``): the running ops' tensors at their largest (an LM's loss)."""
    region_parameter_bytes: tuple[int, ...] = ()
    """Bytes of each region's parameters (what sharding gathers per region: ``sharding``)."""


def fake_step(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    machine: Machine,
    regions: RegionsArg,
    attention: Attention,
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    min_offload_bytes: int,
    rule: SelectiveRule = BUILT_IN,
) -> StepRun:
    """One step of a meta copy of ``model`` on meta copies of ``args`` and ``kwargs``, counted per
    region of ``regions`` (modules of ``model`` are mapped onto the copy's of the same names), a
    selective run's saves split by ``rule``."""
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
    step = StepCounter([name for name, _ in found.regions], machine, eligible, rule)
    handles = []
    for index, (_, module) in enumerate(found.regions):
        handles.append(
            module.register_forward_pre_hook(lambda m, a, kw, i=index: step.region_starts(i, a, kw), with_kwargs=True)
        )
        handles.append(module.register_forward_hook(lambda m, a, out, i=index: step.region_ends(i)))
    meta_args, meta_kwargs = _to_meta(args), _to_meta(kwargs)
    observe = _Observe(step)
    modes: list[Any] = [_AsTarget(machine.device_type, fused=attention is Attention.FUSED), observe]
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
    parameter_bytes = _parameter_bytes(fake)
    grads = step.live.ids_of(p.grad for p in fake.parameters() if p.grad is not None)
    transient_bytes = step.live.transient_peak_bytes(excluded=grads)
    per_region = tuple(_parameter_bytes(module) for _, module in found.regions)
    return StepRun(tuple(step.counts), parameter_bytes, tuple(observe.assumed), transient_bytes, per_region)


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
