"""Measurement families: a "recompute" trial measures one selective split per family of region
calls (one module class, parameter and buffer shapes, input signature) and the family's other calls
reuse it (See Note: [measurement families] in ``offload._regions.measurement``).

White-box in part: the count of measuring re-runs is read by wrapping
``offload._regions.selective._ProfiledFrame._profile_selective`` (the re-run is the cost under
test, and nothing public counts it), and one test builds ``Measurement`` objects with made-up
figures to hold the reuse rule per field. The oracle for the figures is the family's measuring
call: a reusing call's selective fields equal it exactly, and training stays bitwise equal to the
model without the engine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload._regions import selective
from offload._regions.measurement import Measurement, family_of
from offload._regions.selective import SelectiveProfile

WIDTH = 32


class Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, hidden), nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)).sin())


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x).tanh())


class Halves(nn.Module):
    """Blocks of one class and shape: the first ones on the whole batch, the last on half of it."""

    def __init__(self, blocks: list[nn.Module], halved_from: int) -> None:
        super().__init__()
        self.blocks, self.halved_from = nn.ModuleList(blocks), halved_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == self.halved_from:
                x = x[: x.shape[0] // 2]
            x = block(x)
        return x


def _train(model: nn.Module, steps: int, eng=None) -> list[torch.Tensor]:
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, WIDTH)
        if eng is None:
            loss = model(x).square().mean()
        else:
            with eng:
                loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses


def _measuring_reruns(monkeypatch) -> list[str]:
    names: list[str] = []
    original = selective._ProfiledFrame._profile_selective

    def counted(frame):
        names.append(frame.name)
        return original(frame)

    monkeypatch.setattr(selective._ProfiledFrame, "_profile_selective", counted)
    return names


def _run(model: nn.Module, monkeypatch, steps: int = 4):
    torch.manual_seed(0)
    reference = _train(copy.deepcopy(model), steps)
    names = _measuring_reruns(monkeypatch)
    eng = offload.engine(budget_mb=0, policy="selective", regions=list(model.blocks), model=model, min_offload_bytes=0)
    try:
        losses = _train(model, steps, eng)
        trial = next(p for p in eng.profiled_steps if p.stage == "recompute")
    finally:
        eng.close()
    assert all(torch.equal(a, b) for a, b in zip(losses, reference, strict=True))
    return names, trial


def test_identical_blocks_measure_one_split(monkeypatch):
    """Eight identical blocks: one measuring re-run in the trial; every block's split is the first's."""
    torch.manual_seed(0)
    model = Halves([Mlp(64) for _ in range(8)], halved_from=99)
    names, trial = _run(model, monkeypatch)
    assert names == ["blocks.0"]
    first = trial.regions[0]
    assert first.selective_measured() and first.cheap_bytes > 0
    for region in trial.regions[1:]:
        fields = ("selective_ms", "cheap_bytes", "expensive_bytes", "expensive_tensors", "forward_flops")
        assert [getattr(region, f) for f in fields] == [getattr(first, f) for f in fields], region.name


@pytest.mark.parametrize(
    ("blocks", "halved_from", "families"),
    [
        # another class
        (lambda: [Mlp(64), Norm(), Mlp(64), Norm(), Mlp(64)], 99, ["blocks.0", "blocks.1"]),
        # one class, other parameter shapes
        (lambda: [Mlp(64), Mlp(128), Mlp(64), Mlp(128)], 99, ["blocks.0", "blocks.1"]),
        # one class and shape, another input signature
        (lambda: [Mlp(64) for _ in range(4)], 2, ["blocks.0", "blocks.2"]),
    ],
    ids=["class", "parameter-shapes", "input-signature"],
)
def test_each_family_measures_its_own_split(monkeypatch, blocks, halved_from, families):
    """A call that differs in class, parameter shapes or input signature starts a family of its own."""
    torch.manual_seed(0)
    model = Halves(blocks(), halved_from)
    names, trial = _run(model, monkeypatch)
    assert sorted(names) == families
    for region in trial.regions:
        assert region.selective_measured(), region.name


def test_family_key_reads_class_shapes_and_signature():
    """The key itself: equal for identical blocks, different for each thing that makes a family."""
    sig = (((16, WIDTH), torch.float32, torch.device("cpu")),)
    assert family_of(Mlp(64), sig, False) == family_of(Mlp(64), sig, False)
    assert family_of(Mlp(64), sig, False) != family_of(Mlp(128), sig, False)
    assert family_of(Mlp(64), sig, False) != family_of(Norm(), sig, False)
    assert family_of(Mlp(64), sig, False) != family_of(Mlp(64), sig, True)
    half = (((8, WIDTH), torch.float32, torch.device("cpu")),)
    assert family_of(Mlp(64), sig, False) != family_of(Mlp(64), half, False)
    with_buffer = Mlp(64)
    with_buffer.register_buffer("scale", torch.ones(3))
    assert family_of(Mlp(64), sig, False) != family_of(with_buffer, sig, False)


def _split(rerun_ms: float, why_not: str = "") -> SelectiveProfile:
    return SelectiveProfile(
        selective_ms=0.7,
        cheap_bytes=300,
        expensive_bytes=200,
        expensive_tensors=2,
        why_not=why_not,
        rerun_ms=rerun_ms,
        forward_flops=4096,
    )


def _measured(split: SelectiveProfile | None, shares: Measurement | None = None) -> Measurement:
    m = Measurement(name="blocks.1", index=1, input_bytes=10)
    m.forward_ms, m.start, m.end = 1.0, 0.0, 0.010  # a 10 ms backward, its recompute 2 ms
    m.recompute_ms = 2.0
    if split is not None:
        m.add_selective(split)
    m.shares = shares
    return m


def test_a_shared_split_gives_its_figures_but_not_its_rerun_time():
    """The reusing call takes the split's figures, and its backward loses only its own recompute
    (the measuring re-run ran in the other call's backward)."""
    first = _measured(_split(rerun_ms=3.0))
    other = _measured(None, shares=first).profile()
    own = first.profile()
    assert own.backward_ms == pytest.approx(10.0 - 2.0 - 3.0)
    assert other.backward_ms == pytest.approx(10.0 - 2.0)
    for field in ("selective_ms", "cheap_bytes", "expensive_bytes", "expensive_tensors", "forward_flops"):
        assert getattr(other, field) == getattr(own, field), field
    assert other.note == ""


def test_a_shared_split_that_cannot_run_says_why_and_measures_nothing():
    first = _measured(_split(rerun_ms=3.0, why_not="an op wrote in place"))
    other = _measured(None, shares=first).profile()
    assert other.note == "recomputed whole: an op wrote in place"
    assert not other.selective_measured() and other.cheap_bytes == 0


def test_own_split_wins_over_a_shared_one():
    first = _measured(_split(rerun_ms=3.0))
    own = _split(rerun_ms=1.0)
    own = SelectiveProfile(**{**own.__dict__, "cheap_bytes": 77})
    m = _measured(own, shares=first).profile()
    assert m.cheap_bytes == 77
    alone = _measured(None).profile()  # nothing measured, nothing shared
    assert (alone.cheap_bytes, alone.forward_flops, alone.selective_ms) == (0, 0, 0.0)
