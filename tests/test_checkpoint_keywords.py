"""``offload.checkpoint`` under ``torch.utils.checkpoint``'s keywords: a call swapped from one to the
other runs the same. Where a keyword's meaning carries over (``use_reentrant=False``,
``preserve_rng_state``, ``context_fn``, the defaults of ``determinism_check``, ``debug`` and
``early_stop``) the output and every gradient equal torch's bitwise, with dropout drawing from an
RNG seeded apart in forward and backward; where it does not, a ``ValueError`` says why.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import offload


def _dropout_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 16))


def _checkpointed(checkpoint, block: nn.Module, **keywords) -> list[torch.Tensor]:
    """Output and gradients of one checkpointed call, the RNG seeded apart in forward and backward
    (so a re-run that does not restore it draws another dropout mask)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).requires_grad_()
    torch.manual_seed(1)
    y = checkpoint(block, x, **keywords)
    torch.manual_seed(2)
    y.sum().backward()
    out = [y.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_checkpoint_with_torchs_keywords_matches_torch_bitwise(preserve_rng_state):
    block = _dropout_block()
    keywords = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    want = _checkpointed(torch_checkpoint, block, **keywords)
    assert _equal(_checkpointed(offload.checkpoint, block, **keywords), want)
    kept = _checkpointed(torch_checkpoint, block, use_reentrant=False)
    assert _equal(want, kept) is preserve_rng_state, "the premise: the flag changes the re-run's dropout"


def test_checkpoint_keeps_torchs_defaults_for_the_keywords_whose_meaning_carries():
    block = _dropout_block()
    want = _checkpointed(torch_checkpoint, block, use_reentrant=False)
    built = "".join(["def", "ault"])  # equal to "default", not the same object: compared by value
    same = {"determinism_check": built, "debug": False, "early_stop": True}
    assert _equal(_checkpointed(offload.checkpoint, block, use_reentrant=None, **same), want)


def test_checkpoint_with_a_selective_context_fn_matches_torch_bitwise():
    block = _dropout_block()
    saved_ops = [torch.ops.aten.addmm.default, torch.ops.aten.mm.default]
    context_fn = functools.partial(create_selective_checkpoint_contexts, saved_ops)
    want = _checkpointed(torch_checkpoint, block, use_reentrant=False, context_fn=context_fn)
    assert _equal(_checkpointed(offload.checkpoint, block, use_reentrant=False, context_fn=context_fn), want)


def test_checkpoint_enters_context_fns_forward_context_then_its_rerun_context():
    entered: list[str] = []

    class Mark:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            entered.append(self.name)

        def __exit__(self, *exc: object) -> None:
            entered.append(f"/{self.name}")

    block = _dropout_block()
    x = torch.randn(4, 16, requires_grad=True)
    y = offload.checkpoint(block, x, context_fn=lambda: (Mark("forward"), Mark("rerun")))
    assert entered == ["forward", "/forward"]
    y.sum().backward()
    assert entered == ["forward", "/forward", "rerun", "/rerun"]


@pytest.mark.parametrize("given", [None, (), (contextlib.nullcontext(),)])
def test_checkpoint_context_fn_must_give_two_contexts(given):
    """Refused in forward, where the call is, not in backward when the re-run looks for its context."""
    with pytest.raises(TypeError, match="context_fn must return two context managers"):
        offload.checkpoint(_dropout_block(), torch.randn(4, 16, requires_grad=True), context_fn=lambda: given)


@pytest.mark.parametrize(
    ("keyword", "value", "why"),
    [
        ("use_reentrant", True, "the non-reentrant kind"),
        ("determinism_check", "none", "always checked"),
        ("determinism_check", "all", "always checked"),  # any value but "default", whichever way it sorts
        ("debug", True, "no op trace"),
        ("early_stop", False, "always stops"),
    ],
)
def test_checkpoint_refuses_torchs_keywords_whose_meaning_does_not_carry(keyword, value, why):
    with pytest.raises(ValueError, match=rf"checkpoint\(\.\.\., {keyword}={value!r}\) is not supported: .*{why}"):
        offload.checkpoint(_dropout_block(), torch.randn(4, 16, requires_grad=True), **{keyword: value})


def test_checkpoint_passes_other_keywords_to_fn():
    def fn(x, *, scale):
        return x * scale

    x = torch.randn(4, requires_grad=True)
    offload.checkpoint(fn, x, scale=3.0).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0))
