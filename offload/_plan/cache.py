"""Plans that survive a restart: ``offload.engine(..., regions=..., plan_cache=PATH)``.

Profiling costs a few training steps per input family (``profiler``). A restarted job with the
same model, budget, policy, torch and machine would measure the same thing again, so what the
profiling found is written to a JSON file, one entry per input family (the same tensors, dtypes
and devices; only their sizes change): the family's fit (``fit.ProfileFit``: the points measured,
from which the plan for any shape of the family is derived), the final plans of the shapes that
were measured, with the profiles they were made from (so that a budget that follows free memory
can re-plan without profiling), and the link calibration. The next run finds it and runs its first
step under a plan, for the shapes measured before and for new ones the fit reaches alike:
``eng.profiling`` is False from the first step on.

An entry is filed under the sha256 of its key, whose parts are all written out beside it:

    inputs   the input family of the first region (tensor ranks, dtypes, devices)
    regions  a fingerprint of the regions: names, every submodule's type, parameter shapes and dtypes
    budget   budget_mb in bytes, or "auto" and the reserve
    policy   the policy's name
    torch    torch.__version__ (and offload's version, and the autocast state at lookup)
    machine  the probe's key for this machine (``offload._memory.probe.machine_key``)

What is trusted: nothing that does not parse, carry this module's format marker and version,
and match every part of the key, and whose plans have one decision per region, by name, and
every field of the type and in the range its dataclass declares (checked on load, field by field:
see ``_checked_fields``). Anything else (a missing file, a corrupt or truncated one, a foreign
JSON file, an entry for another model, budget, torch or machine, a number stored as a string, a
NaN) is ignored and the family profiled as if there were no file; the engine warns about it
once, naming what did not hold up (a missing file is not worth a warning), and the file is
rewritten after profiling. Decisions are stored by their value (``Decision(value)``), so a new
decision needs no change here.

Writes replace the file atomically (a temporary file in the same directory, then
``os.replace``): a reader sees the old file or the new one, never half of one.

Ranks: every rank keeps its own file. When ``WORLD_SIZE`` > 1 the path gains the rank
(``RANK``, else ``LOCAL_RANK``): ``plans.json`` becomes ``plans.rank3.json``. Ranks of one job
may then share a directory without racing, and ranks whose regions differ (pipeline stages)
keep their own plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

from .._cost import RegionProfile, Scope
from .._version import __version__ as OFFLOAD_VERSION
from .fit import ProfileFit
from .planner import Decision, Plan, RegionPlan

__all__ = ["CachedPlan", "PlanCache", "rank_path"]

log = logging.getLogger(__name__)

FORMAT = "offload-plan-cache"
"""The marker a plan cache file carries; a JSON file without it is someone else's."""
VERSION = 3
"""Layout version; a file with another is ignored (and rewritten). 2: one entry per input family,
with its fit; 3: the saves outside the regions, as profiles and plan rows."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachedPlan:
    """What a previous run left for one input family."""

    fit: ProfileFit
    """The family's fit: the points measured (the plans of other shapes are derived from it)."""
    plans: tuple[tuple[str, Plan, tuple[RegionProfile, ...], float], ...]
    """(the signature's repr, its final plan, the profiles it was made from, the rest-of-step ms)
    for each shape that was measured."""
    link_scale: Optional[float]
    """The calibration of the probe's transfer costs (None: never calibrated)."""


def rank_path(path: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """``path``, with the rank in its name when the job has more than one (see the module docstring)."""
    try:
        world_size = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world_size = 1
    if world_size <= 1:
        return path
    rank = environ.get("RANK")
    if rank is None:  # LOCAL_RANK repeats on every node: a shared file system needs the host too
        rank = f"{socket.gethostname()}.{environ.get('LOCAL_RANK', '0')}"
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def regions_fingerprint(regions: list[tuple[str, torch.nn.Module]]) -> str:
    """sha256 of the regions' names, submodule types, parameter shapes, dtypes and whether each
    trains (a frozen weight saves less: LoRA), and their buffers' shapes and dtypes."""
    parts = []
    for name, module in regions:
        parts.append(
            [
                name,
                [f"{type(m).__module__}.{type(m).__qualname__}" for _, m in module.named_modules()],
                [[p_name, list(p.shape), str(p.dtype), p.requires_grad] for p_name, p in module.named_parameters()],
                [[b_name, list(b.shape), str(b.dtype)] for b_name, b in module.named_buffers()],
            ]
        )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _signature_device(signature: tuple) -> torch.device:
    for item in signature:
        if isinstance(item, tuple) and len(item) == 3 and isinstance(item[2], torch.device):
            return item[2]
    return torch.device("cpu")


class PlanCache:
    """One engine's view of its plan cache file.

    Args:
        path: the file (created, with its directory, on the first write); per rank, see above.
        budget: how the engine's budget is filed: bytes, None, or e.g. ``"auto reserve 2147483648"``.
        policy: the policy's name.
        machine_key: the probe's key of this machine for a device (called once per signature).
    """

    def __init__(
        self, path: Path, *, budget: Union[float, str, None], policy: str, machine_key: Callable[[torch.device], str]
    ) -> None:
        self.path = rank_path(Path(path))
        self._budget = budget
        self._policy = policy
        self._machine_key = machine_key
        self._warned = False
        self._looked_up = False

    # ------------------------------------------------------------------ reading

    def lookup(
        self, family: tuple, regions: list[tuple[str, torch.nn.Module]], profile_names: Sequence[str]
    ) -> Optional[CachedPlan]:
        """What was saved for this input family and these regions, or None (with at most one warning per engine)."""
        first, self._looked_up = not self._looked_up, True
        entries = self._read_entries(warn=first)
        if entries is None:
            return None
        key = self.key(family, regions)
        entry = entries.get(_digest(key))
        if entry is None:
            if first and entries:
                self._warn(f"it holds no plan for this run ({_nearest_difference(key, entries)}); profiling again")
            return None
        try:
            if entry.get("key") != key:
                raise ValueError("the entry's key does not match its digest")
            names = [name for name, _ in regions]
            cached = _decode(entry, names, profile_names)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            self._warn(f"its plan for these inputs is unusable ({error}); profiling again")
            return None
        log.info("offload: plans for inputs %s read from %s", family, self.path)
        return cached

    def _read_entries(self, *, warn: bool) -> Optional[dict]:
        """The file's entries; None when it is missing or not a plan cache (warned about once)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            if warn:
                self._warn(f"it cannot be read ({error})")
            return None
        try:
            data = json.loads(text)
        except ValueError as error:
            if warn:
                self._warn(f"it is corrupt or truncated ({error})")
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            if warn:
                self._warn("it is not an offload plan cache")
            return None
        if data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
            if warn:
                self._warn(f"it is not in layout version {VERSION}")
            return None
        return data["entries"]

    def _warn(self, why: str) -> None:
        if self._warned:
            log.info("offload: plan cache %s: %s", self.path, why)
            return
        self._warned = True
        log.warning(
            "offload: ignoring the plan cache %s: %s; it is rewritten once these inputs are profiled", self.path, why
        )

    # ------------------------------------------------------------------ writing

    def store(
        self,
        family: tuple,
        regions: list[tuple[str, torch.nn.Module]],
        fit: ProfileFit,
        plans: list[tuple[object, Plan, tuple[RegionProfile, ...], float]],
        link_scale: Optional[float],
    ) -> None:
        """File what was found for this input family (its fit, the measured shapes' final plans,
        each by the repr of its signature), keeping the file's other entries; never raises for I/O."""
        key = self.key(family, regions)
        entries = self._read_entries(warn=False) or {}
        entries[_digest(key)] = {
            "key": key,
            "fit": fit.to_dict(),
            "plans": [
                {
                    "inputs": repr(signature),
                    "plan": _encode_plan(plan),
                    "profiles": [_encode_profile(p) for p in profiles],
                    "other_ms": other_ms,
                }
                for signature, plan, profiles, other_ms in plans
            ],
            "link_scale": link_scale,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        data = {"format": FORMAT, "version": VERSION, "entries": entries}
        tmp_path = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_path = tempfile.mkstemp(prefix=f".{self.path.name}-", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())  # the rename must not land before the bytes do
            os.replace(tmp_path, self.path)
            tmp_path = None
            log.info("offload: plans for inputs %s written to %s", family, self.path)
        except (OSError, TypeError, ValueError) as error:  # I/O, or a profile JSON cannot carry
            log.warning(
                "offload: could not write the plan cache %s (%s); the next run profiles again", self.path, error
            )
        finally:
            if tmp_path is not None:
                try:
                    os.unlink(tmp_path)
                except OSError:
                    pass  # the temporary file is already gone

    def key(self, family: tuple, regions: list[tuple[str, torch.nn.Module]]) -> dict:
        """The key an entry for this input family and these regions is filed under (its parts written out)."""
        device = _signature_device(family)
        return {
            "inputs": repr(family),
            "regions": regions_fingerprint(regions),
            "budget": self._budget,
            "policy": self._policy,
            "torch": torch.__version__,
            "offload": OFFLOAD_VERSION,  # the planner's rules change with it
            "autocast": _autocast_state(device),  # bf16 autocast halves what is saved
            "machine": self._machine_key(device),
        }


def _autocast_state(device: torch.device) -> str:
    """Autocast at lookup (inside the first region's forward) on the inputs' device type."""
    if not torch.is_autocast_enabled(device.type):
        return "off"
    return str(torch.get_autocast_dtype(device.type))


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _nearest_difference(key: dict, entries: dict) -> str:
    """Which parts of the key the closest entry differs in, e.g. "its budget, torch differ"."""
    best: Optional[list[str]] = None
    for entry in entries.values():
        other = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(other, dict):
            continue
        differ = [part for part in key if other.get(part) != key[part]]
        if best is None or len(differ) < len(best):
            best = differ
    return "no readable entry" if best is None else f"the saved plans differ in: {', '.join(best)}"


def _encode_profile(profile: RegionProfile) -> dict:
    return dataclasses.asdict(profile) | {"scope": profile.scope.value}


def _decode_profile(stored: object, what: str) -> RegionProfile:
    return RegionProfile(**_checked_fields(RegionProfile, stored, what))


def _encode_region(r: RegionPlan) -> dict:
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} | {
        "decision": r.decision.value,
        "scope": r.scope.value,
    }


def _decode_region(stored: object, what: str) -> RegionPlan:
    return RegionPlan(**_checked_fields(RegionPlan, stored, what))


def _encode_plan(plan: Plan) -> dict:
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "pace"}
    fields["regions"] = [_encode_region(r) for r in plan.regions]
    fields["outside"] = [_encode_region(r) for r in plan.outside]
    return fields


def _decode_plan(stored: object, what: str) -> Plan:
    if not isinstance(stored, dict):
        raise ValueError(f"{what} is not an object")
    fields = dict(stored)
    fields.pop("pace", None)  # a live reading, never saved (older files: ignored)
    rows = {part: fields.pop(part, None) for part in ("regions", "outside")}
    plan = _checked_fields(Plan, fields, what)
    for part, items in rows.items():
        if not isinstance(items, list):
            raise ValueError(f"{what}.{part} is not a list")
        plan[part] = tuple(_decode_region(r, f"{what}.{part}[{i}]") for i, r in enumerate(items))
    return Plan(**plan)


# -- what a field may hold ---------------------------------------------------------------------
#
# Every number, string and flag read back is checked before an object is made of it: a cache
# edited by hand, or written by a bug, fails here (one warning, profiling again), never in the
# first forward, in ``eng.plan`` or in ``explain``. The check follows the field's annotation, so a
# field added to a profile or a plan is checked with no change here (an annotation no check knows
# is a KeyError: the entry is refused, and the restart tests fail); a field whose range is not its
# annotation's is named in ``_CHECK_BY_FIELD``.


def _count(value: object, what: str) -> int:
    """Bytes, tensors, FLOPs: an int >= 0 (a bool, a float or a string is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} {value!r} is not a whole number >= 0")
    return value


def _optional_count(value: object, what: str) -> Optional[int]:
    """A budget in bytes, or None: no limit."""
    return None if value is None else _count(value, what)


def _ms(value: object, what: str) -> float:
    """A time: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} {value!r} is not a finite number >= 0")
    return float(value)


def _ms_or_never(value: object, what: str) -> float:
    """A transfer time: a number >= 0, infinite where the link cannot carry the bytes (``planner``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:  # NaN is not >= 0
        raise ValueError(f"{what} {value!r} is not a number >= 0 (or infinity)")
    return float(value)


def _signed_ms(value: object, what: str) -> float:
    """A difference of times (the predicted overhead): any finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} {value!r} is not a finite number")
    return float(value)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r} is not a string")
    return value


def _flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not true or false")
    return value


def _decision(value: object, what: str) -> Decision:
    return Decision(_text(value, what))


def _scope(value: object, what: str) -> Scope:
    return Scope(_text(value, what))


_CHECK_BY_ANNOTATION: dict[str, Callable[[object, str], object]] = {
    "int": _count,
    "int | None": _optional_count,
    "float": _ms,
    "str": _text,
    "bool": _flag,
    "Decision": _decision,
    "Scope": _scope,
}
_CHECK_BY_FIELD: dict[tuple[type, str], Callable[[object, str], object]] = {
    (RegionPlan, "transfer_ms"): _ms_or_never,
    (Plan, "predicted_overhead_ms"): _signed_ms,
}
"""The fields whose range is not their annotation's."""


def _checked_fields(cls: type, stored: object, what: str) -> dict:
    """``stored``'s fields of the dataclass ``cls``, each checked (see above); ``ValueError`` naming
    the first one unknown or out of its range (a missing one is left to the constructor)."""
    if not isinstance(stored, dict):
        raise ValueError(f"{what} is not an object")
    annotations = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    checked = {}
    for name, value in stored.items():
        if name not in annotations:
            raise ValueError(f"{what} has an unknown field {name!r}")
        check = _CHECK_BY_FIELD.get((cls, name)) or _CHECK_BY_ANNOTATION[annotations[name]]
        checked[name] = check(value, f"{what}.{name}")
    return checked


def _decode(entry: dict, names: list[str], profile_names: Sequence[str]) -> CachedPlan:
    link_scale = entry["link_scale"]
    if link_scale is not None and not (isinstance(link_scale, float) and math.isfinite(link_scale) and link_scale > 0):
        raise ValueError(f"link_scale {link_scale!r} is not a positive number")
    if not isinstance(entry["plans"], list):
        raise ValueError("plans is not a list")
    plans = []
    for i, stored in enumerate(entry["plans"]):
        what = f"plans[{i}]"
        plan = _decode_plan(stored["plan"], f"{what}.plan")
        if not isinstance(stored["profiles"], list):
            raise ValueError(f"{what}.profiles is not a list")
        profiles = tuple(_decode_profile(p, f"{what}.profiles[{j}]") for j, p in enumerate(stored["profiles"]))
        if [r.name for r in plan.regions] != names or [p.name for p in profiles] != list(profile_names):
            raise ValueError("its regions are not this engine's")
        inputs = _text(stored["inputs"], f"{what}.inputs")
        plans.append((inputs, plan, profiles, _ms(stored["other_ms"], f"{what}.other_ms")))
    if not isinstance(entry["fit"], dict):
        raise ValueError("fit is not an object")
    fit = ProfileFit.from_dict(entry["fit"], profile_names)
    return CachedPlan(fit=fit, plans=tuple(plans), link_scale=link_scale)
