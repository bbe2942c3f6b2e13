"""Validated, frozen configuration of one engine.

Everything a user can set lives here, once, with its unit and trade-off. The
engine reads it; nothing mutates it. Validation raises ``ValueError`` or
``TypeError`` naming the field, the value given, the valid range and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Optional, Union

import torch

from ._budget import DEFAULT_RESERVE_MB
from ._cost import MB
from ._plan.policy import get_policy, policy_names

__all__ = ["DEFAULT_MIN_OFFLOAD_MB", "Config", "devices_here", "parse_device"]


DEFAULT_MIN_OFFLOAD_BYTES = 64 * 1024
"""Saved tensors smaller than this stay where they are: below ~64 KiB a copy (CUDA launch,
event, pool lookup) or a spill file costs more in fixed overhead than the bytes it frees."""

DEFAULT_MIN_OFFLOAD_MB = DEFAULT_MIN_OFFLOAD_BYTES / MB
"""``DEFAULT_MIN_OFFLOAD_BYTES`` in MiB (0.0625), the unit of every size ``offload.engine`` takes."""

DEFAULT_SPILL_WORKERS = 2
"""Threads writing and reading spill files. Two keep one write and one read in flight at once
without fighting the compute threads for cores on small machines."""


def _check_mb(name: str, value: object, meaning: str) -> Optional[float]:
    """``value`` MB as a float, or None; ``meaning``: what None and 0 mean for ``name``, for its error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of megabytes (int or float) or None for no limit, "
            f"got {value!r} of type {type(value).__name__}"
        )
    value = float(value)
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0 (megabytes), got {value!r}; {meaning}")
    return value


AUTO_BUDGET = "auto"
"""The ``budget_mb`` that follows free memory (``offload._budget``)."""


def _as_number(text: str) -> Optional[float]:
    """``text`` read as a number of megabytes (``"512"``), or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else value


def _check_budget(budget_mb: object, reserve_mb: object) -> tuple[Optional[float], Optional[float]]:
    """(budget MB, reserve MB): one of them None. A string budget must be "auto"; a reserve only goes with it."""
    if isinstance(budget_mb, str):
        if budget_mb != AUTO_BUDGET:
            number = _as_number(budget_mb)
            hint = f"budget_mb={number!r} (a number, not a string), " if number is not None else ""
            raise ValueError(
                f"budget_mb={budget_mb!r}: the only string budget is {AUTO_BUDGET!r} (follow free memory); "
                f"pass {hint}budget_mb='auto', a number of megabytes, or None for no limit"
            )
        if reserve_mb is None:
            return None, float(DEFAULT_RESERVE_MB)
        if isinstance(reserve_mb, bool) or not isinstance(reserve_mb, (int, float)):
            raise TypeError(
                f"reserve_mb must be a number of megabytes (int or float) to keep free on the device, "
                f"got {reserve_mb!r} of type {type(reserve_mb).__name__}"
            )
        reserve = float(reserve_mb)
        if math.isnan(reserve) or reserve < 0:
            raise ValueError(
                f"reserve_mb={reserve_mb!r}: must be a number >= 0 (megabytes kept free on the device); "
                f"use 0 to move nothing the device can hold, or more than the device to move everything eligible"
            )
        return None, reserve
    if reserve_mb is not None:
        raise ValueError(
            f"reserve_mb={reserve_mb!r} applies only to budget_mb='auto', but budget_mb={budget_mb!r}; "
            f"pass budget_mb='auto' to keep reserve_mb free, or drop reserve_mb to keep the fixed budget"
        )
    return _check_mb(
        "budget_mb", budget_mb, "use None for no limit or 0 to move everything eligible off the device"
    ), None


SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def devices_here() -> list[str]:
    """The devices an engine can run on here, for messages: "cpu", then "cuda:0".."cuda:N-1".
    ``is_available()`` and ``device_count()`` ask the driver; neither initializes CUDA."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"cuda:{i}" for i in range(count))]


def parse_device(device: Union[str, int, torch.device, None]) -> Optional[torch.device]:
    """A ``torch.device`` of a supported type that this machine has, from what a user passed (None
    stays None). An absent one is an error: an engine on a device nothing is saved on would pass
    every tensor through and manage nothing, without a word."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device; pass e.g. 'cuda', 'cuda:1' or 'cpu'") from e
    here = devices_here()
    example = here[1] if len(here) > 1 else here[0]
    fix = (
        f"this machine has {', '.join(here)}: pass one of them (e.g. device={example!r}), "
        f"or device=None (the device of the first tensor saved)"
    )
    if parsed.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"device={device!r}: type {parsed.type!r} is not supported; valid device types are "
            f"{', '.join(repr(t) for t in SUPPORTED_DEVICE_TYPES)}; {fix}"
        )
    if parsed.type == "cuda":
        count = len(here) - 1
        if count == 0:
            raise ValueError(f"device={device!r}: this machine has no CUDA device (torch {torch.__version__}); {fix}")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device={device!r}: there is no CUDA device {parsed.index}; {fix}")
    return parsed


def _check_spill_dir(spill_dir: object) -> Optional[Path]:
    if spill_dir is None:
        return None
    if not isinstance(spill_dir, (str, os.PathLike)):
        raise TypeError(f"spill_dir must be a path (str or os.PathLike) or None, got {spill_dir!r}")
    path = Path(spill_dir).expanduser()
    # A symlink whose target is missing (or a loop) reads as missing, yet nothing can be made there:
    # every spill would fail. It, or a dangling link among the parents to be made, is refused by name.
    dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        which = "is" if dangling == path else f"cannot be made: its parent {str(dangling)!r} is"
        raise ValueError(
            f"spill_dir {str(path)!r} {which} a symbolic link to {os.readlink(dangling)!r}, which does not "
            f"resolve to a directory (missing, or a loop); create its target, or pass an existing directory "
            f"or None for a private temporary one"
        )
    if path.exists() and not path.is_dir():
        raise ValueError(f"spill_dir {str(path)!r} exists and is not a directory; pass a directory path")
    # A missing spill_dir is made by the first spill and removed at close (``_memory.spill``), so nothing
    # is made here: checking the settings leaves the disk as it was. Its nearest existing
    # ancestor must let this process make it.
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        where = "is" if existing == path else f"does not exist, and its parent {str(existing)!r} is"
        raise ValueError(
            f"spill_dir {str(path)!r} {where} not a writable directory for this process; pass a writable "
            f"directory or None for a private temporary one"
        )
    return path


def _check_plan_cache(plan_cache: object) -> Optional[Path]:
    if plan_cache is None:
        return None
    if not isinstance(plan_cache, (str, os.PathLike)):
        raise TypeError(f"plan_cache must be a file path (str or os.PathLike) or None, got {plan_cache!r}")
    path = Path(plan_cache).expanduser()
    if path.is_dir():
        raise ValueError(
            f"plan_cache={str(path)!r} is a directory; pass a file path, e.g. {str(path / 'plans.json')!r}"
        )
    return path


def _reserve_bytes(reserve_mb: float) -> int:
    """Bytes of a reserve in MB; an infinite one (more than any machine) becomes a huge int."""
    return int(reserve_mb * MB) if math.isfinite(reserve_mb) else 1 << 80


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How one engine behaves. Build it through ``offload.engine(...)``."""

    budget_bytes: Optional[int] = None
    """Engine-managed activation bytes allowed on the compute device, copies in flight
    included. None: no limit (the hooks only count), or the budget follows free memory
    (``reserve_bytes`` set). 0: move everything eligible."""
    reserve_bytes: Optional[int] = None
    """Set by ``budget_mb="auto"``: bytes to keep free on the compute device; the budget in force
    is then resident + free - reserve, read as the step runs (``offload._budget``). A larger
    reserve moves more and leaves more room to the rest of the step (default
    ``DEFAULT_RESERVE_MB``, see there why); 0 moves nothing the device can hold; more than the
    device moves everything eligible. None: the budget is ``budget_bytes``."""
    spill_dir: Optional[Path] = None
    """Where the spill file is made (in a private directory; both unlinked once the file is open, so
    nothing of it stays on disk after the process, ``kill -9`` included); None: the system temp dir.
    On the CPU the disk is the tier behind the budget; on CUDA it takes what exceeds host memory."""
    host_budget_bytes: Optional[int] = None
    """Pinned host bytes the engine may hold (CUDA). None: bounded only by available RAM
    (psutil), keeping a reserve so the host never swaps. Beyond it tensors spill to disk."""
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    """Saved storages smaller than this pass through untouched (fixed costs beat the savings)."""
    device: Optional[torch.device] = None
    """Compute device whose tensors the engine manages. None: the device of the first eligible
    tensor saved. Tensors on other devices pass through."""
    prefetch: bool = True
    """Bring moved tensors back ahead of use in backward (reverse save order), within the budget.
    False: reload each one only when backward asks for it (slower; for debugging)."""
    spill_workers: int = DEFAULT_SPILL_WORKERS
    """Threads doing spill-file writes and reads."""
    plan_cache: Optional[Path] = None
    """A JSON file where final region plans are kept across restarts (``offload._plan.cache``):
    a restarted job with the same model, shapes, budget, policy, torch and machine runs its first
    step under the saved plan, without profiling. None: plans live as long as the engine."""
    policy: str = "offload"
    """How regions meet the budget: "none" (keep, only count), "offload" (move tensors), "recompute"
    (checkpoint every region), "selective" (re-run every region's cheap ops, keep or move its matmul
    and attention outputs), "auto" (measure, then choose per region), or a registered policy."""

    @property
    def follows_free_memory(self) -> bool:
        """True for ``budget_mb="auto"``: the budget in force is read from free memory."""
        return self.reserve_bytes is not None

    @classmethod
    def from_user(
        cls,
        budget_mb: Union[float, str, None] = None,
        *,
        reserve_mb: Optional[float] = None,
        spill_dir: Union[str, os.PathLike, None] = None,
        host_budget_mb: Optional[float] = None,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        min_offload_mb: Optional[float] = None,
        device: Union[str, int, torch.device, None] = None,
        prefetch: bool = True,
        spill_workers: int = DEFAULT_SPILL_WORKERS,
        policy: Optional[str] = None,
        plan_cache: Union[str, os.PathLike, None] = None,
        has_regions: bool = False,
    ) -> "Config":
        """Validate what a user passed to ``offload.engine``; ``policy`` None: "auto" with regions,
        else "offload". ``min_offload_mb``, where given, sets the threshold in MiB (the engine's
        unit) and replaces ``min_offload_bytes`` (kept for offload's own callers)."""
        if policy is None:
            policy = "auto" if has_regions else "offload"
        budget, reserve = _check_budget(budget_mb, reserve_mb)
        host_budget = _check_mb(
            "host_budget_mb",
            host_budget_mb,
            "use None for no cap (available RAM less a reserve) or 0 to send everything past the device to disk",
        )
        if min_offload_mb is not None:
            mb = _check_mb("min_offload_mb", min_offload_mb, "use 0 to manage every save, whatever its size")
            min_offload_bytes = round(mb * MB) if mb is not None else min_offload_bytes
        if isinstance(min_offload_bytes, bool) or not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be an int >= 0 (bytes), got {min_offload_bytes!r}")
        if isinstance(spill_workers, bool) or not isinstance(spill_workers, int) or spill_workers < 1:
            raise ValueError(f"spill_workers must be an int >= 1, got {spill_workers!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
        device = parse_device(device)
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a policy name, one of {list(policy_names())}; got {policy!r}")
        chosen = get_policy(policy)  # unknown name -> ValueError listing the valid ones
        if policy == "none" and (budget is not None or reserve is not None):
            raise ValueError(
                f"policy='none' keeps everything and only counts, but budget_mb={budget_mb!r} was given; "
                f"use budget_mb=None, or another policy ('offload', 'recompute', 'auto')"
            )
        if plan_cache is not None and not has_regions:
            raise ValueError(
                f"plan_cache={plan_cache!r} keeps region plans and needs regions= (e.g. regions=model.blocks); "
                f"without regions there is no plan to keep: drop plan_cache"
            )
        if chosen.needs_regions and not has_regions:
            raise ValueError(
                f"policy={policy!r} chooses per region and needs regions= (e.g. regions=model.blocks); "
                f"without regions use policy='offload'"
            )
        return cls(
            policy=policy,
            budget_bytes=None if budget is None else int(budget * MB),
            reserve_bytes=None if reserve is None else _reserve_bytes(reserve),
            spill_dir=_check_spill_dir(spill_dir),
            plan_cache=_check_plan_cache(plan_cache),
            host_budget_bytes=None if host_budget is None else int(host_budget * MB),
            min_offload_bytes=min_offload_bytes,
            device=device,
            prefetch=prefetch,
            spill_workers=spill_workers,
        )
