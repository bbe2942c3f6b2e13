"""A re-run region sees what its first run saw, or the error says what changed.

Oracle: the same region without the engine. A cache argument (Hugging Face's names) is kept from
a region that will be re-run, as Hugging Face's own checkpointed layers do, so the first run and
the re-run compute the same thing; any other argument the forward changes and that makes the
re-run save something else is named in the error. One test is white-box: the rule itself
(``offload._regions.regions.without_cache``, a pure function of a module and its keyword
arguments), checked against Hugging Face's names.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload._regions.regions import without_cache

MACHINE = offload.MachineProfile(device_type="cpu", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0)


class Cached(nn.Module):
    """A block that stores its keys in a cache object and reads them back when they are there, as a
    cross-attention layer with a filled encoder-decoder cache does."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.k = nn.Linear(width, width)
        self.q = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cache=None, use_cache: bool = False, memo=None) -> torch.Tensor:
        store = cache if cache is not None else memo
        if store is not None and "k" in store.__dict__:
            k = store.k
        else:
            k = torch.tanh(self.k(x))
            if store is not None and (use_cache or memo is not None):
                store.k = k
        return torch.sigmoid(self.q(x) * k)


class Box:
    pass


class Stack(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Cached() for _ in range(depth))

    def forward(self, x: torch.Tensor, argument: str) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, **{argument: Box(), **({"use_cache": True} if argument == "cache" else {})})
        return x.sum()


def step(model: Stack, argument: str, eng=None):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model.zero_grad(set_to_none=True)
    if eng is None:
        loss = model(x, argument)
    else:
        with eng:
            loss = model(x, argument)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], x.grad


@pytest.mark.parametrize("policy", ["recompute", "selective"])
def test_a_cache_argument_is_kept_from_a_rerun_region(policy, spill_dir):
    reference = step(Stack(), "cache")
    model = Stack()
    eng = offload.engine(0, regions=model.blocks, model=model, policy=policy, machine=MACHINE, spill_dir=spill_dir)
    for _ in range(3):  # "selective" measures first; every step re-runs the blocks once it plans
        got = step(model, "cache", eng)
        assert torch.equal(got[0], reference[0]) and torch.equal(got[2], reference[2])
        for a, b in zip(got[1], reference[1], strict=True):
            assert torch.equal(a, b)
    assert eng.stats.recomputed_regions >= 2
    eng.close()


def test_without_cache_follows_hugging_faces_rule():
    kwargs = {"cache": object(), "past_key_values": object(), "layer_past": object(), "use_cache": True, "x": 1}
    assert without_cache(nn.Linear(1, 1), kwargs) == {
        "cache": None,
        "past_key_values": None,
        "layer_past": None,
        "use_cache": False,
        "x": 1,
    }
    reader = nn.Linear(1, 1)
    reader._can_checkpoint_with_cache = True  # a layer that only reads its cache keeps it
    kept = without_cache(reader, kwargs)
    assert kept["cache"] is kwargs["cache"] and kept["use_cache"] is False
    assert kwargs["use_cache"] is True, "the caller's dict is left alone"


def test_another_argument_the_forward_changed_is_named(spill_dir):
    model = Stack()
    eng = offload.engine(0, regions=model.blocks, model=model, policy="recompute", machine=MACHINE, spill_dir=spill_dir)
    with pytest.raises(offload.OffloadError, match=r"Its forward changed argument 'memo' \(Box\)"):
        step(model, "memo", eng)
    eng.close()
