"""The selective replay hands back a stashed output only for the same op on the same input shapes.

A region whose re-run takes another branch must not be handed the forward's stashed outputs: its
backward would then use inputs the stash was not made from and give wrong gradients, silently.
``test_selective.py`` covers another op on the re-run (mm in the forward, bmm in the re-run); this
covers the same op on other shapes, which a check of the op's name alone would let through.
White-box: one region's ``selective_checkpoint`` (``offload._regions.selective``) is run directly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload._regions.selective import selective_checkpoint

WIDTH, ROWS, HALF = 32, 8, 16


def test_the_same_expensive_op_on_other_shapes_on_the_rerun_raises_naming_the_region():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(WIDTH, WIDTH))
    calls = []

    def narrow(x):
        calls.append(1)
        if len(calls) == 1:
            return (x @ w).tanh()  # aten.mm on (8, 32) x (32, 32)
        return (x[:, :HALF] @ w[:HALF]).tanh()  # aten.mm again, on (8, 16) x (16, 32): the same output shape

    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    out, run = selective_checkpoint(narrow, (x,), {}, "blocks.3")
    assert run.selective
    with pytest.raises(offload.OffloadError, match=r"region 'blocks\.3'.*aten\.mm.*\(8, 16\).*\(8, 32\)"):
        out.sum().backward()
