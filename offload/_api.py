"""The public constructor: ``offload.engine(...)``, every setting a typed keyword, checked at the boundary.

Owns what a user's call meets before an engine exists: the signature (what ``help()``, IDEs and
mypy read), the did-you-mean error for a misspelt keyword, the deprecated keywords (each moved to
its one way with a ``DeprecationWarning`` naming it), the named machine's datasheet profile, and
validation into a ``Config``; then it builds the ``Engine`` (``_engine``), which owns the lifecycle.

    offload.engine(512, polcy="auto")            -> TypeError: 'polcy' (did you mean 'policy'?)
    offload.engine(512, link=my_link)             -> DeprecationWarning; seams=Seams(link=my_link)
    offload.engine(512, machine=offload.machine("h100-sxm"))  -> plans on the datasheet's figures
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import warnings
from typing import Any, Callable, Optional, TypeVar, Union, cast

import torch

from ._budget import FreeMemory
from ._config import DEFAULT_MIN_OFFLOAD_MB, DEFAULT_SPILL_WORKERS, Config
from ._cost import MB, MachineProfile
from ._engine import Engine
from ._memory.sharded import sharding_for
from ._predict.machines import Machine
from ._regions.regions import RegionsArg
from .seams import Seams

__all__ = ["check_keywords", "engine", "engine_keywords"]


_SEAM_KEYWORDS = ("link", "host", "memory")
"""The engine's old seam keywords, deprecated: each fills the same field of ``offload.Seams``."""

_DEPRECATED_KEYWORDS = (*_SEAM_KEYWORDS, "min_offload_bytes", "shared_inputs")
"""Keywords ``offload.engine`` still takes for one release, each with a ``DeprecationWarning``
naming its replacement; not in the signature, so ``help()``, IDEs and mypy show only the one way."""


def engine_keywords() -> tuple[str, ...]:
    """Every keyword ``offload.engine()`` takes, read from its signature (deprecated ones left out),
    so a keyword added there is listed without editing a list."""
    return tuple(inspect.signature(engine).parameters)


def check_keywords(given: Any, *, where: str = "offload.engine()", extra: tuple[str, ...] = ()) -> None:
    """Raise ``TypeError`` for a keyword in ``given`` that ``where`` does not take: the error names it,
    the closest valid keyword and every valid one (the engine's, plus ``extra`` of the caller's own).
    A deprecated keyword is taken (``offload.engine`` warns about it itself)."""
    valid = (*engine_keywords(), *extra)
    unknown = [name for name in given if name not in valid and name not in _DEPRECATED_KEYWORDS]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise TypeError(f"{where} got unknown keyword(s) {', '.join(hints)}; valid keywords: {', '.join(valid)}")


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"offload.engine({old}=...) is deprecated and goes in the next release; {new}",
        DeprecationWarning,
        stacklevel=4,  # the user's call: _deprecated <- _take_old_keywords <- the wrapper <- the caller
    )


def _take_old_keywords(kwargs: dict) -> Any:
    """Move the deprecated keywords in ``kwargs`` to their replacements, warning for each; return the
    deprecated ``shared_inputs`` (None where not given), which has no keyword of its own any more."""
    old_seams = {name: kwargs.pop(name) for name in _SEAM_KEYWORDS if name in kwargs}
    if old_seams:
        named = ", ".join(f"{name}=..." for name in old_seams)
        _deprecated(named.removesuffix("=..."), f"pass seams=offload.Seams({named}) (a test's stand-ins, in one place)")
        seams = kwargs.get("seams")
        if seams is not None:
            if not isinstance(seams, Seams):
                raise TypeError(f"seams must be an offload.Seams, got {type(seams).__name__}")
            twice = [name for name in old_seams if getattr(seams, name) is not None]
            if twice:
                raise ValueError(
                    f"offload.engine() got {', '.join(twice)} both as a keyword and in seams=; pass each seam once, "
                    f"in seams=offload.Seams(...)"
                )
            kwargs["seams"] = dataclasses.replace(seams, **old_seams)
        else:
            kwargs["seams"] = Seams(**old_seams)
    if "min_offload_bytes" in kwargs:
        nbytes = kwargs.pop("min_offload_bytes")
        if "min_offload_mb" in kwargs:
            raise ValueError(
                "offload.engine() got both min_offload_bytes= and min_offload_mb=; pass min_offload_mb only (MiB)"
            )
        _deprecated("min_offload_bytes", "pass min_offload_mb= in MiB, the budget's unit (65536 bytes = 0.0625)")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(
                f"min_offload_bytes must be an int >= 0 (bytes), got {nbytes!r}; better, pass min_offload_mb="
            )
        kwargs["min_offload_mb"] = nbytes / MB  # exact: a division by a power of two
    shared_inputs = kwargs.pop("shared_inputs", None)
    if shared_inputs is not None:
        _deprecated(
            "shared_inputs",
            "declare rank-identical saves one way, with `with offload.sharded(group):` around the regions' calls "
            "(under policy='recompute' a region saves only its inputs, so that declares exactly them)",
        )
    return shared_inputs


_Build = TypeVar("_Build", bound=Callable[..., "Engine"])


def _keywords_checked(public: _Build) -> _Build:
    """``offload.engine`` as written (its signature is what ``help()``, IDEs and mypy read), behind
    a wrapper that turns a misspelt keyword into a did-you-mean ``TypeError`` and takes the
    deprecated ones with a warning. A wrapper, not a ``**unknown`` catch in the signature: mypy
    then flags a misspelt or deprecated keyword before the code runs."""

    @functools.wraps(public)
    def checked(*args: Any, **kwargs: Any) -> Engine:
        shared_inputs = _take_old_keywords(kwargs)
        check_keywords(kwargs)
        if shared_inputs is None:
            return public(*args, **kwargs)
        bound = inspect.signature(public).bind(*args, **kwargs)
        bound.apply_defaults()
        return _engine(*bound.args, **bound.kwargs, shared_inputs=shared_inputs)

    return cast(_Build, checked)


@_keywords_checked
def engine(
    budget_mb: Union[float, str, None] = None,
    *,
    model: Optional[torch.nn.Module] = None,
    regions: Optional[RegionsArg] = None,
    policy: Optional[str] = None,
    reserve_mb: Optional[float] = None,
    host_budget_mb: Optional[float] = None,
    min_offload_mb: float = DEFAULT_MIN_OFFLOAD_MB,
    device: Union[str, int, torch.device, None] = None,
    prefetch: bool = True,
    spill_dir: Union[str, os.PathLike, None] = None,
    spill_workers: int = DEFAULT_SPILL_WORKERS,
    plan_cache: Union[str, os.PathLike, None] = None,
    machine: Union[Machine, MachineProfile, None] = None,
    seams: Optional[Seams] = None,
) -> Engine:
    """Make an engine that keeps at most ``budget_mb`` MiB of saved activations on the device.

    Every size is in MiB (2**20 bytes). Misspelt keywords raise ``TypeError`` naming the closest one.

    Args:
        budget_mb: MiB of engine-managed activations allowed on the compute device, copies in
            flight included. None: no limit (the engine only counts). 0: move everything eligible
            off the device. "auto": follow free memory, keeping ``reserve_mb`` free on the device;
            tensors move only when free memory falls below it (see ``offload._budget``).
        model: the model the engine serves: its parameters and buffers are never moved, and
            ``regions="auto"`` searches it for its blocks. The one way to name it (a decorated
            module is named by being decorated).
        regions: the units the policy decides on: ``"auto"`` (the model's repeated blocks: the
            block classes a Hugging Face model names, else the heaviest module type in containers;
            see ``offload._regions.blocks``), an iterable of modules (``model.blocks``), or a filter
            ``(module, qualified_name) -> bool``. "auto" and a filter search ``model=`` (or the
            module the engine decorates).
        policy: how regions meet the budget, one of ``offload.policies()``: "none" (keep, only
            count), "offload" (move tensors; the default without regions), "recompute" (re-run
            every region in backward), "selective" (re-run cheap ops, keep or move matmul and
            attention outputs), "auto" (measure, then choose per region; the default with
            regions), or a name given to ``offload.register_policy``. All but "none" and "offload"
            need ``regions=``.
        reserve_mb: with ``budget_mb="auto"`` only: MiB to keep free on the device (default
            ``offload._budget.DEFAULT_RESERVE_MB``). More moves more and leaves more room to the
            rest of the step; 0 moves nothing the device can hold.
        host_budget_mb: MiB of pinned host memory the engine may hold below a CUDA device; beyond
            it tensors spill to disk. None: available RAM less a reserve, so the host never swaps.
        min_offload_mb: saved storages smaller than this many MiB stay where they are: a copy's
            fixed cost (launch, event, bookkeeping) outweighs what it frees. Default 0.0625
            (64 KiB); 0 manages every save.
        device: the compute device whose tensors the engine manages ('cpu', 'cuda', 'cuda:1').
            None: the device of the first tensor saved. Tensors on other devices pass through.
        prefetch: bring moved tensors back ahead of use in backward, within the budget. False:
            reload each only when backward asks for it (slower; for debugging).
        spill_dir: where the spill file is made (unlinked once open, so nothing stays on disk).
            None: a private temporary directory.
        spill_workers: threads doing the spill file's writes and reads (default 2: one write and
            one read in flight without taking the compute's cores on a small machine).
        plan_cache: with regions: a JSON file keeping final plans across restarts, so a restarted
            job does not profile again (see ``offload._plan.cache``). None: plans live with the engine.
        machine: the machine plans are priced on instead of measuring this one with
            ``offload.probe()``: a named GPU (``offload.machine("h100-sxm")``: its datasheet
            figures, as ``explain`` says) or a ``MachineProfile`` (``offload.probe()``'s, measured).
        seams: stand-ins for where the engine meets the machine (an ``offload.Seams`` of a link,
            a host, a free-memory reading): for tests, simulations and benchmarks; see
            ``offload.seams``. None: this machine's own.

    The old keywords ``link=``, ``host=``, ``memory=`` (now ``seams=``), ``min_offload_bytes=``
    (now ``min_offload_mb=``) and ``shared_inputs=`` (now ``offload.sharded(group)``) still work for
    one release, each with a ``DeprecationWarning``.
    """
    return _engine(
        budget_mb,
        model=model,
        regions=regions,
        policy=policy,
        reserve_mb=reserve_mb,
        host_budget_mb=host_budget_mb,
        min_offload_mb=min_offload_mb,
        device=device,
        prefetch=prefetch,
        spill_dir=spill_dir,
        spill_workers=spill_workers,
        plan_cache=plan_cache,
        machine=machine,
        seams=seams,
    )


def _machine_profile_of(machine: object) -> tuple[Optional[MachineProfile], str]:
    """(what the planner reads, where its figures come from) for ``machine=``; a ``TypeError`` names
    the type given, never its repr (a profile's runs to a screenful)."""
    if machine is None:
        return None, ""
    if isinstance(machine, Machine):
        return machine.machine_profile(), f"{machine.name}: {machine.source}"
    if isinstance(machine, MachineProfile):
        return machine, ""
    raise TypeError(
        f"machine must be a named machine (offload.machine(name), one of offload.machines()) or a measured "
        f"offload.MachineProfile (offload.probe()), got {type(machine).__name__}"
    )


def _engine(
    budget_mb: Union[float, str, None],
    *,
    model: Optional[torch.nn.Module],
    regions: Optional[RegionsArg],
    policy: Optional[str],
    reserve_mb: Optional[float],
    host_budget_mb: Optional[float],
    min_offload_mb: float,
    device: Union[str, int, torch.device, None],
    prefetch: bool,
    spill_dir: Union[str, os.PathLike, None],
    spill_workers: int,
    plan_cache: Union[str, os.PathLike, None],
    machine: Union[Machine, MachineProfile, None],
    seams: Optional[Seams],
    shared_inputs: Any = None,
) -> Engine:
    """``offload.engine``'s work: validate every setting, then build the ``Engine``."""
    config = Config.from_user(
        budget_mb,
        has_regions=regions is not None,
        policy=policy,
        reserve_mb=reserve_mb,
        host_budget_mb=host_budget_mb,
        min_offload_mb=min_offload_mb,
        device=device,
        prefetch=prefetch,
        spill_dir=spill_dir,
        spill_workers=spill_workers,
        plan_cache=plan_cache,
    )
    profile, datasheet = _machine_profile_of(machine)
    if seams is None:
        seams = Seams()
    elif not isinstance(seams, Seams):
        raise TypeError(f"seams must be an offload.Seams, got {type(seams).__name__}")
    memory = FreeMemory.from_user(seams.memory)
    if memory is not None and not config.follows_free_memory:
        raise ValueError(
            f"Seams(memory=...) reads free memory for budget_mb='auto', but budget_mb={budget_mb!r}; "
            f"pass budget_mb='auto' or drop memory="
        )
    sharding = None
    if shared_inputs is not None:
        if regions is None:
            raise ValueError(
                "shared_inputs= declares the inputs of regions run as recompute; pass regions= (and a policy "
                "that recomputes), or declare the saves themselves with `with offload.sharded(group):`"
            )
        if config.policy != "recompute":
            raise ValueError(
                f"shared_inputs= needs policy='recompute', got policy={config.policy!r}: the inputs are declared "
                "where a region is recomputed, and every rank must recompute the same regions (a profiled policy "
                "plans each rank apart); pass policy='recompute'"
            )
        if isinstance(shared_inputs, (bool, str, int)):
            raise TypeError(
                f"shared_inputs must be a torch.distributed process group, got {shared_inputs!r}; "
                "pass torch.distributed.group.WORLD for every rank"
            )
        sharding = sharding_for(shared_inputs, what="offload.engine(shared_inputs=...)")
    return Engine(
        config,
        model=model,
        regions=regions,
        machine=profile,
        link=seams.link,
        memory=memory,
        shared_inputs=sharding,
        host=seams.host,
        _datasheet=datasheet,
        _checked=True,
    )
