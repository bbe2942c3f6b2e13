"""Region profiles as functions of the input shape: a few measured shapes predict the rest.

Numbers in, numbers out: nothing here touches torch, so the fits are tested with made-up points.

What a region saves and how long it takes follows the tokens it sees. With ``n`` the elements of
the region's first tensor input (batch x sequence x width; the width is fixed for one model) and
``s`` its sequence length (the second-last dimension: batch-first layouts):

    saved bytes, tensors   ~ c1·n                 almost every op saves a per-token tensor
                           + c2·n·s               attention without a fused kernel: (s, s) scores
    times                  ~ c0 + c1·n + c2·n·s   launch overhead, matmuls, attention

Each field of ``RegionProfile`` is fitted on its own, by least squares on relative error with
coefficients >= 0, over the first basis that explains every measured point within the field's
tolerance (``BYTE_TOLERANCE``, ``TIME_TOLERANCE``), tried in the order::

    bytes            [n]   [n, n·s]   [1, n]   [1, n, n·s]     (no fixed part: nothing saved for nothing)
    tensor counts    [1]   [1, n]   [n]                        (the same ops save at every shape)
    times            [n]   [1, n]   [n, n·s]   [1, n, n·s]     (a fixed part next: launches, bookkeeping)

and where none does, the basis that misses least.

Times follow FLOPs, and FLOPs are exact: a region re-run to measure a selective run has its
matmuls, attention and convolutions counted (``RegionProfile.forward_flops``, torch's flop
counter), fitted like a size (``BYTE_TOLERANCE``, the byte bases). Once a region has counts at two
shapes, its forward, backward and recompute times are fitted on that count's fit ``f`` instead of
on ``n·s`` (the selective re-run, the cheap ops, stays on the shape's terms)::

    times, FLOPs counted   [f]   [1, f]   [n, f]   [1, n, f]     (``FLOP_TIME_BASES``)

so the curve of attention's n·s comes from two exact counts, not from noisy times: a [n, n·s] fit
to three timed points, each one step's, extrapolates their noise, and leave-one-out (below) then
prefers [n], which is 13-15 % low at MiniGPT's longest lengths (measured on a 2-vCPU AMD EPYC,
``bench/results/shapes-cpu.md``, "times fitted on the FLOPs counted": per-token forward time rises
26 % from 131 to 509 tokens, its FLOPs per token 22 %).

Times are noisy (each point is one step's), and a basis that lies within 20 % of every point can
still miss a trend: ``[n]`` through a region whose attention grows as ``n·s`` is 20 % high at the
short end and 20 % low at the long one. So from three points on a time field takes instead the
basis whose fits to all points but one predict the one left out best, on average (leave-one-out),
a richer basis winning only where it cuts that miss below ``HELD_OUT_MARGIN`` of a simpler one's:
a term that only fits noise predicts the held-out points worse, and loses.

A basis of k terms needs k points whose features separate its terms; with one point a field is
proportional to ``n``. A field measured less often than its primary (the recompute and selective
times, measured only on trial steps; the selective byte split) is its primary's fit times the
mean ratio of the two at the points where both were measured, until it has two points of its own.

State is bounded: at most ``MAX_POINTS`` points per field; a new point at a shape already held
replaces it (the later measurement wins), otherwise the point that crowds its neighbours most
goes, never the smallest or the largest (they bound the range that was measured).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

from .._cost import RegionProfile, Scope

__all__ = [
    "BYTE_TOLERANCE",
    "BYTE_BASES",
    "FLOP_TIME_BASES",
    "HELD_OUT_MARGIN",
    "MAX_POINTS",
    "TIME_BASES",
    "TIME_FIELDS",
    "TIME_TOLERANCE",
    "FieldFit",
    "ProfileFit",
    "Shape",
]

BYTE_TOLERANCE = 0.01
"""Largest relative miss at a measured point for a byte or tensor-count fit to be accepted over a
richer basis. Sizes are exact and deterministic; 1 % leaves room for allocator rounding."""
TIME_TOLERANCE = 0.20
"""The same for times: CPU timings drift from step to step (10-20 % on the 2-vCPU AMD EPYC of
``bench/results/demo-cpu-selective.md``), and each point is one step's,
so a richer basis that only fits that noise (and extrapolates it) is not taken."""
MAX_POINTS = 16
"""Points kept per field, whatever the number of shapes seen."""
HELD_OUT_MARGIN = 0.8
"""A richer time basis is taken over a simpler one only when its mean held-out miss is at most
this fraction of the simpler one's: a few percent better is noise, not a term."""

BYTE_BASES: tuple[tuple[str, ...], ...] = (("n",), ("n", "ns"), ("1", "n"), ("1", "n", "ns"))
COUNT_BASES: tuple[tuple[str, ...], ...] = (("1",), ("1", "n"), ("n",))
TIME_BASES: tuple[tuple[str, ...], ...] = (("n",), ("1", "n"), ("n", "ns"), ("1", "n", "ns"))
"""The bases tried for sizes, tensor counts and times, in order (see the module docstring)."""
FLOP_TIME_BASES: tuple[tuple[str, ...], ...] = (("f",), ("1", "f"), ("n", "f"), ("1", "n", "f"))
"""The bases tried for a region's times once its FLOPs were counted; ``f`` is the FLOPs fit."""

_SINGULAR = 1e-9
"""Pivot (of the equilibrated normal equations) below which the points do not separate the terms."""

_BYTE_FIELDS = (
    "forward_flops",
    "saved_bytes",
    "input_bytes",
    "num_tensors",
    "largest_tensor_bytes",
    "cheap_bytes",
    "expensive_bytes",
    "expensive_tensors",
)
_COUNT_FIELDS = ("num_tensors", "expensive_tensors")
TIME_FIELDS = ("forward_ms", "backward_ms", "recompute_ms", "selective_ms")
"""The fields that are times: a trial round times them (the profiler gives the fit their median
over the rounds)."""
_FLOP_TIMES = ("forward_ms", "backward_ms", "recompute_ms")
"""Times fitted on the FLOPs once counted: those of the forward's matmuls and attention (backward
is about twice them). Not ``selective_ms``: a selective re-run is the cheap ops, which the count
leaves out (norms, activations, copies grow with ``n``; a softmax over scores with ``n·s``)."""
_SIZES = ("saved_bytes", "input_bytes", "num_tensors", "largest_tensor_bytes")
"""What every profiling step measures (its times may not count: ``ProfileFit.add``)."""
_PRIMARY = {
    "backward_ms": "forward_ms",
    "recompute_ms": "forward_ms",
    "selective_ms": "forward_ms",
    "cheap_bytes": "saved_bytes",
    "expensive_bytes": "saved_bytes",
    "expensive_tensors": "num_tensors",
}
"""A field measured less often than another, and that other (see the module docstring)."""


def _key(shape: "Shape") -> tuple[int, int]:
    return shape.n, shape.s


@dataclasses.dataclass(frozen=True)
class Shape:
    """The features of one input shape: ``n`` elements of the first tensor input, ``s`` its
    sequence length, and the dimensions themselves (for ``explain()``)."""

    n: int
    s: int
    dims: tuple[int, ...] = ()

    @staticmethod
    def of(dims: Sequence[int]) -> Shape:
        """Features of a tensor of these dimensions (see the module docstring for ``s``)."""
        dims = tuple(int(d) for d in dims)
        n = max(1, math.prod(dims))
        s = dims[-2] if len(dims) >= 3 else (dims[-1] if len(dims) == 2 else 1)
        return Shape(n=n, s=max(1, s), dims=dims)

    def terms(self) -> dict[str, float]:
        return {"1": 1.0, "n": float(self.n), "ns": float(self.n) * float(self.s)}

    def __str__(self) -> str:
        return str(self.dims) if self.dims else f"n={self.n}"


@dataclasses.dataclass(frozen=True)
class _Model:
    basis: tuple[str, ...]
    coefficients: tuple[float, ...]
    flops: Optional[_Model] = None
    """The FLOPs fit its ``f`` term reads (None: a basis without ``f``)."""

    def at(self, shape: Shape) -> float:
        terms = _features(shape, self.flops)
        return sum(c * terms[b] for b, c in zip(self.basis, self.coefficients, strict=True))


def _features(shape: Shape, flops: Optional[_Model]) -> dict[str, float]:
    """The terms a basis may name at ``shape``: ``1``, ``n``, ``ns`` and, given a FLOPs fit, ``f``."""
    terms = shape.terms()
    if flops is not None:
        terms["f"] = flops.at(shape)
    return terms


_ZERO = _Model(("n",), (0.0,))


def _solve(rows: list[list[float]], values: list[float]) -> Optional[list[float]]:
    """Least squares on relative error (each row weighted by 1/value): the normal equations,
    equilibrated and solved by Gaussian elimination with partial pivoting. None where singular."""
    k = len(rows[0])
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for row, value in zip(rows, values, strict=True):
        w = 1.0 / (value * value)
        for i in range(k):
            b[i] += w * row[i] * value
            for j in range(k):
                a[i][j] += w * row[i] * row[j]
    scale = [math.sqrt(a[i][i]) for i in range(k)]  # the terms differ by orders of magnitude
    a = [[a[i][j] / (scale[i] * scale[j]) for j in range(k)] for i in range(k)]
    b = [b[i] / scale[i] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < _SINGULAR:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] / scale[i] for i in range(k)]


class FieldFit:
    """The points of one field of one region, and the model fitted to them."""

    def __init__(
        self,
        tolerance: float,
        bases: tuple[tuple[str, ...], ...],
        *,
        cross_validate: bool = False,
        flops: Optional[FieldFit] = None,
    ) -> None:
        self.tolerance = tolerance
        self.bases = bases
        self.cross_validate = cross_validate
        """Times: from three points on, the basis that predicts each point best from the others
        (``_held_out_miss``), rather than the first within the tolerance (see the module docstring)."""
        self.flops = flops
        """Times: the region's FLOPs fit; once it holds counts at two shapes, ``FLOP_TIME_BASES``
        are tried instead of ``bases``, their ``f`` its value at each shape."""
        self.points: list[tuple[Shape, float]] = []
        self.version = 0
        """Counts the points added: a fit reading this one (``flops``) refits when it changed."""
        self._model: Optional[_Model] = None
        self._model_version: Optional[int] = None

    def add(self, shape: Shape, value: float) -> None:
        """Add (or, at a shape already held, replace) a point; keep at most ``MAX_POINTS``."""
        self.points = [(p, v) for p, v in self.points if _key(p) != _key(shape)]
        self.points.append((shape, float(value)))
        if len(self.points) > MAX_POINTS:
            self.points.remove(self._most_crowded())
        self.version += 1
        self._model = None

    def _most_crowded(self) -> tuple[Shape, float]:
        ordered = sorted(self.points, key=lambda point: _key(point[0]))

        def size(i: int) -> float:
            return math.log(ordered[i][0].n * ordered[i][0].s)

        return ordered[min(range(1, len(ordered) - 1), key=lambda i: size(i + 1) - size(i - 1))]

    def __bool__(self) -> bool:
        return bool(self.points)

    def shapes(self) -> int:
        """Distinct shapes among the points."""
        return len({_key(p) for p, _ in self.points})

    def model(self) -> _Model:
        version = self.flops.version if self.flops is not None else None
        if self._model is None or self._model_version != version:
            flops = self.flops.model() if self.flops is not None and self.flops.measured_at() >= 2 else None
            self._model, self._model_version = self._fit(flops), version
        return self._model

    def measured_at(self) -> int:
        """Distinct shapes with a value above 0: a FLOPs fit from fewer is proportional to ``n``,
        which says nothing the shape's terms do not (and would take ``n·s`` from a time fit)."""
        return len({_key(p) for p, v in self.points if v > 0})

    def _fit(self, flops: Optional[_Model]) -> _Model:
        points = [(p, v) for p, v in self.points if v > 0]
        if not points:
            return _ZERO
        bases = self.bases if flops is None else FLOP_TIME_BASES
        if self.cross_validate and len(points) >= 3:
            chosen = self._cross_validated(points, bases, flops)
            if chosen is not None:
                return chosen
        zeros = [p for p, v in self.points if v <= 0]  # nothing there: missed by what the model gives
        largest = max(v for _, v in points)
        best: Optional[tuple[float, _Model]] = None
        for basis in bases:
            if len(basis) > len(points):
                continue
            coefficients = _fit_basis(basis, points, flops)
            if coefficients is None:
                continue
            model = _Model(basis, tuple(coefficients), flops if "f" in basis else None)
            miss = max([abs(model.at(p) - v) / v for p, v in points] + [model.at(p) / largest for p in zeros])
            if miss <= self.tolerance:
                return model
            if best is None or miss < best[0]:
                best = (miss, model)
        assert best is not None  # one positive point always solves the proportional basis
        return best[1]

    def _cross_validated(
        self, points: list[tuple[Shape, float]], bases: tuple[tuple[str, ...], ...], flops: Optional[_Model]
    ) -> Optional[_Model]:
        """The basis whose fits to all points but one miss the one left out least on average; a
        richer basis must beat a simpler one by ``HELD_OUT_MARGIN``. None where no basis can be scored."""
        best: Optional[tuple[float, tuple[str, ...]]] = None
        for basis in bases:
            if len(basis) > len(points) - 1:
                continue
            score = _held_out_miss(basis, points, flops)
            if score is not None and (best is None or score < best[0] * HELD_OUT_MARGIN):
                best = (score, basis)
        if best is None:
            return None
        coefficients = _fit_basis(best[1], points, flops)
        if coefficients is None:
            return None
        return _Model(best[1], tuple(coefficients), flops if "f" in best[1] else None)

    def at(self, shape: Shape) -> float:
        return max(0.0, self.model().at(shape))


def _fit_basis(
    basis: tuple[str, ...], points: Sequence[tuple[Shape, float]], flops: Optional[_Model] = None
) -> Optional[list[float]]:
    """Coefficients of ``basis`` over ``points`` (all >= 0), or None where they do not separate or
    one is negative. ``flops``: the FLOPs fit a basis with ``f`` reads."""
    rows = [[_features(p, flops)[b] for b in basis] for p, _ in points]
    coefficients = _solve(rows, [v for _, v in points])
    return None if coefficients is None or any(c < 0 for c in coefficients) else coefficients


def _held_out_miss(
    basis: tuple[str, ...], points: Sequence[tuple[Shape, float]], flops: Optional[_Model] = None
) -> Optional[float]:
    """Mean relative miss at each point of ``basis`` fitted to the others; None where a fit fails."""
    misses = []
    for i, (shape, value) in enumerate(points):
        coefficients = _fit_basis(basis, [q for j, q in enumerate(points) if j != i], flops)
        if coefficients is None:
            return None
        misses.append(abs(_Model(basis, tuple(coefficients), flops).at(shape) - value) / value)
    return sum(misses) / len(misses)


class _RegionFit:
    """Every field of one region's profile, fitted over the shapes measured."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.note = ""
        self.scope = Scope.REGION
        self.fields = {
            f: FieldFit(BYTE_TOLERANCE, COUNT_BASES if f in _COUNT_FIELDS else BYTE_BASES) for f in _BYTE_FIELDS
        }
        flops = self.fields["forward_flops"]
        self.fields.update(
            {
                f: FieldFit(TIME_TOLERANCE, TIME_BASES, cross_validate=True, flops=flops if f in _FLOP_TIMES else None)
                for f in TIME_FIELDS
            }
        )
        self.ratios: dict[str, list[tuple[Shape, float]]] = {f: [] for f in _PRIMARY}

    def add(self, shape: Shape, profile: RegionProfile, *, times: bool) -> None:
        for field in _SIZES:
            self.fields[field].add(shape, getattr(profile, field))
        if profile.forward_flops > 0:  # exact, whatever the step's times were
            self.fields["forward_flops"].add(shape, profile.forward_flops)
        if not times:
            return
        self.fields["forward_ms"].add(shape, profile.forward_ms)
        measured = {
            "backward_ms": profile.backward_ms > 0,
            "recompute_ms": profile.recompute_ms > 0,
            "selective_ms": profile.selective_measured(),
            "cheap_bytes": profile.selective_measured(),
            "expensive_bytes": profile.selective_measured(),
            "expensive_tensors": profile.selective_measured(),
        }
        for field, was_measured in measured.items():
            if not was_measured:
                continue
            value = getattr(profile, field)
            self.fields[field].add(shape, value)
            primary = getattr(profile, _PRIMARY[field])
            if primary > 0:
                kept = [(p, r) for p, r in self.ratios[field] if _key(p) != _key(shape)]
                self.ratios[field] = (kept + [(shape, value / primary)])[-MAX_POINTS:]
        if profile.note:
            self.note = profile.note
        self.scope = profile.scope

    def add_sizes(self, shape: Shape, saved_bytes: int, num_tensors: int) -> None:
        self.fields["saved_bytes"].add(shape, saved_bytes)
        self.fields["num_tensors"].add(shape, num_tensors)

    def value(self, field: str, shape: Shape) -> float:
        fit = self.fields[field]
        primary = _PRIMARY.get(field)
        if primary is not None and fit.shapes() < 2:
            ratios = self.ratios[field]
            if not ratios:
                return 0.0  # never measured: 0 is "not measured" to the planner
            return self.value(primary, shape) * sum(r for _, r in ratios) / len(ratios)
        return fit.at(shape)

    def derive(self, shape: Shape) -> RegionProfile:
        value = self.value
        return RegionProfile(
            name=self.name,
            note=self.note,
            scope=self.scope,
            forward_flops=round(value("forward_flops", shape)),
            saved_bytes=round(value("saved_bytes", shape)),
            input_bytes=round(value("input_bytes", shape)),
            num_tensors=round(value("num_tensors", shape)),
            largest_tensor_bytes=round(value("largest_tensor_bytes", shape)),
            cheap_bytes=round(value("cheap_bytes", shape)),
            expensive_bytes=round(value("expensive_bytes", shape)),
            expensive_tensors=round(value("expensive_tensors", shape)),
            forward_ms=value("forward_ms", shape),
            backward_ms=value("backward_ms", shape),
            recompute_ms=value("recompute_ms", shape),
            selective_ms=value("selective_ms", shape),
        )


def _basis_name(model: _Model) -> str:
    """A time fit's basis for ``describe()``: ``f`` spelled as the FLOPs fit's own basis."""
    if model.flops is None:
        return "+".join(model.basis)
    flops = "flops(" + "+".join(model.flops.basis) + ")"
    return "+".join(flops if b == "f" else b for b in model.basis)


def _points_to_json(points: list[tuple[Shape, float]]) -> list:
    return [[p.n, p.s, list(p.dims), v] for p, v in points]


def _shape_from_json(item: list) -> Shape:
    n, s, dims = item[0], item[1], item[2]
    if (
        isinstance(n, bool)
        or isinstance(s, bool)
        or not (isinstance(n, int) and isinstance(s, int) and n > 0 and s > 0)
        or not isinstance(dims, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
    ):
        raise ValueError(f"bad shape {item[:3]!r}")
    return Shape(n=n, s=s, dims=tuple(dims))


def _number_from_json(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"bad value {value!r}")
    return float(value)


class ProfileFit:
    """The fits of every region of one engine for one family of inputs (the same tensors, dtypes and
    devices; only their sizes change), and of the step's time outside the regions."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._regions = [_RegionFit(name) for name in names]
        self._other = FieldFit(TIME_TOLERANCE, TIME_BASES, cross_validate=True)
        self.measured: list[Shape] = []
        """Shapes whose whole profiles were measured (not only their sizes), oldest first, bounded."""

    def add(self, shape: Shape, profiles: Sequence[RegionProfile], *, times: bool = True) -> None:
        """A profiling step's profiles at ``shape``: their sizes, and with ``times`` their times
        (a time of 0 is "not measured"). Only shapes whose times count are ``measured``."""
        if len(profiles) != len(self._regions):
            raise ValueError(f"got {len(profiles)} profiles for {len(self._regions)} regions")
        for fit, profile in zip(self._regions, profiles, strict=True):
            fit.add(shape, profile, times=times)
        if times:
            self.measured = [s for s in self.measured if _key(s) != _key(shape)] + [shape]
            del self.measured[:-MAX_POINTS]

    def add_sizes(self, shape: Shape, index: int, saved_bytes: int, num_tensors: int) -> None:
        """What region ``index`` was seen to save at ``shape`` on a step under a plan (exact)."""
        self._regions[index].add_sizes(shape, saved_bytes, num_tensors)

    def add_other(self, shape: Shape, other_ms: float) -> None:
        """A measured step's time outside the regions at ``shape`` (embedding, head, loss, optimizer)."""
        if other_ms > 0:
            self._other.add(shape, other_ms)

    def other_ms(self, shape: Shape) -> float:
        """The step's predicted time outside the regions at ``shape`` (0 before any was measured)."""
        return self._other.at(shape)

    def __bool__(self) -> bool:
        """Whether anything was measured (sizes at least)."""
        return bool(self._regions) and bool(self._regions[0].fields["saved_bytes"])

    def has(self, field: str) -> bool:
        """Whether some region has ``field`` measured (``"recompute_ms"``: a trial step ran)."""
        return any(r.fields[field] for r in self._regions)

    def derive(self, shape: Shape) -> tuple[tuple[RegionProfile, ...], float]:
        """(profiles, other_ms) predicted at ``shape``."""
        return tuple(r.derive(shape) for r in self._regions), self.other_ms(shape)

    def saved_bytes(self, index: int, shape: Shape) -> int:
        """Region ``index``'s predicted saved bytes at ``shape``."""
        return int(round(self._regions[index].value("saved_bytes", shape)))

    def distance(self, shape: Shape) -> float:
        """How far ``shape`` lies outside the shapes measured: its element count over the largest
        measured, or the least measured over it (at most 1.0 inside their range)."""
        sizes = [s.n for s in self.measured]
        return max(shape.n / max(sizes), min(sizes) / shape.n)

    def describe(self) -> str:
        """Which shapes the fits come from, and the bases of the bytes and forward-time fits."""
        bytes_bases = sorted({"+".join(r.fields["saved_bytes"].model().basis) for r in self._regions})
        time_bases = sorted({_basis_name(r.fields["forward_ms"].model()) for r in self._regions})
        shapes = ", ".join(str(s) for s in self.measured)
        return f"measured at {shapes}; bytes ~ {' | '.join(bytes_bases)}, forward ms ~ {' | '.join(time_bases)}"

    def to_dict(self) -> dict:
        """JSON-ready points, for the plan cache (``from_dict`` reads them back)."""
        return {
            "regions": [
                {
                    "name": r.name,
                    "note": r.note,
                    "scope": r.scope.value,
                    "fields": {f: _points_to_json(fit.points) for f, fit in r.fields.items()},
                    "ratios": {f: _points_to_json(points) for f, points in r.ratios.items()},
                }
                for r in self._regions
            ],
            "other": _points_to_json(self._other.points),
            "measured": [[s.n, s.s, list(s.dims)] for s in self.measured],
        }

    @staticmethod
    def from_dict(data: dict, names: Sequence[str]) -> ProfileFit:
        """The inverse of ``to_dict``. ``ValueError``, ``KeyError`` or ``TypeError`` where ``data``
        is not a fit of regions named ``names``."""
        stored_regions = data["regions"]
        if [r["name"] for r in stored_regions] != list(names):
            raise ValueError("its regions are not this engine's")
        fit = ProfileFit(names)
        for region, stored in zip(fit._regions, stored_regions, strict=True):
            if not isinstance(stored["note"], str):
                raise ValueError(f"note {stored['note']!r} is not a string")
            region.note = stored["note"]
            region.scope = Scope(stored["scope"])
            for field, points in stored["fields"].items():
                target = region.fields[field]  # KeyError for a field this version does not know
                for item in points:
                    target.add(_shape_from_json(item), _number_from_json(item[3]))
            for field, points in stored["ratios"].items():
                if field not in region.ratios:
                    raise ValueError(f"unknown field {field!r}")
                region.ratios[field] = [(_shape_from_json(item), _number_from_json(item[3])) for item in points]
        for item in data["other"]:
            fit._other.add(_shape_from_json(item), _number_from_json(item[3]))
        fit.measured = [_shape_from_json(item) for item in data["measured"]][-MAX_POINTS:]
        if not fit:
            raise ValueError("it holds no measured shape")
        return fit
