"""Which ops a selective policy saves and which it re-runs in backward: the rule a prediction prices.

The engine's own selective policy saves the outputs of every matmul, attention and convolution
(``_regions.selective.EXPENSIVE_OPS``) and re-runs the rest: ``BUILT_IN``, the default. Public
recipes choose otherwise, op by op: torchtitan's op-level selective checkpointing saves ``mm`` and
the fused attention kernels and re-runs every second ``mm`` of a block (``TORCHTITAN_OP``). A
``SelectiveRule`` names the saved ops and, optionally, the n-th matmuls re-run anyway; the fake step
(``count.StepCounter``) asks it of every forward op of a region, so the same FLOP and byte counts
price what is re-run (its roofline time) and what is dropped (the saves only re-run ops made):

    op in a region's forward ──rule.saves(op, matmul_index)──▶ saved: its outputs stashed, kept or moved
                                                              └▶ re-run: its time in the selective re-run

A rule other than ``BUILT_IN`` prices a policy this engine does not run (torch's selective
checkpointing does); it is priced with the engine's host costs all the same, as a dispatch mode per
op is what torch's runs too. Numbers and op names only; nothing here runs a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .._regions.selective import is_expensive

__all__ = ["BUILT_IN", "MATMULS", "RULES", "TORCHTITAN_OP", "SelectiveRule", "get_rule"]

MATMULS = frozenset(("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"))
"""The ops ``every_nth_matmul_recomputed`` counts, by aten packet name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectiveRule:
    """Which forward ops of a region a selective run saves (see the module docstring)."""

    name: str
    saved_ops: Optional[frozenset[str]] = None
    """aten packet names whose outputs are saved ("mm", "_scaled_dot_product_flash_attention");
    None: the engine's built-in set (``_regions.selective.is_expensive``)."""
    every_nth_matmul_recomputed: int = 0
    """Of a region's forward matmuls (``MATMULS``), every n-th (the n-th, 2n-th, ...) is re-run even
    where ``saved_ops`` names it; 0: none is."""
    source: str = ""
    """Where the rule comes from (a recipe's file), or "given"."""

    def __post_init__(self) -> None:
        n = self.every_nth_matmul_recomputed
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n == 1:
            raise ValueError(
                f"SelectiveRule.every_nth_matmul_recomputed must be 0 (none) or an int >= 2, got {n!r}; "
                "1 would re-run every matmul: leave the matmuls out of saved_ops instead"
            )
        if self.saved_ops is not None:
            if isinstance(self.saved_ops, str) or not all(isinstance(op, str) for op in self.saved_ops):
                raise TypeError(f"SelectiveRule.saved_ops takes aten op names, e.g. {{'mm'}}, got {self.saved_ops!r}")
            unknown = sorted(op for op in self.saved_ops if not hasattr(torch.ops.aten, op))
            if unknown:
                raise ValueError(f"SelectiveRule.saved_ops: {unknown} are not aten ops of this torch")
            object.__setattr__(self, "saved_ops", frozenset(self.saved_ops))

    def saves(self, func: Any, matmul_index: int) -> bool:
        """Whether a selective run saves the output of ``func`` (an aten OpOverload), the
        ``matmul_index``-th matmul of its region's forward (1-based; 0 when it is none)."""
        if self.saved_ops is None:
            saved = is_expensive(func)
        else:  # an out= overload runs as a re-run op, as ``is_expensive`` says why
            schema = getattr(func, "_schema", None)
            functional = schema is None or not schema.is_mutable
            saved = functional and getattr(getattr(func, "overloadpacket", None), "__name__", "") in self.saved_ops
        n = self.every_nth_matmul_recomputed
        return saved and not (n and matmul_index and matmul_index % n == 0)

    def describe(self) -> str:
        saved = (
            "every matmul, attention and convolution" if self.saved_ops is None else ", ".join(sorted(self.saved_ops))
        )
        recomputed = (
            f"; every {self.every_nth_matmul_recomputed}-th matmul re-run anyway"
            if self.every_nth_matmul_recomputed
            else ""
        )
        return f"{self.name}: saves {saved}{recomputed}; re-runs the rest" + (
            f" ({self.source})" if self.source else ""
        )


def is_matmul(func: Any) -> bool:
    """Whether ``func`` counts towards ``every_nth_matmul_recomputed``."""
    return getattr(getattr(func, "overloadpacket", None), "__name__", "") in MATMULS


BUILT_IN = SelectiveRule(name="built-in", source="this engine's selective: offload._regions.selective.EXPENSIVE_OPS")
TORCHTITAN_OP = SelectiveRule(
    name="torchtitan-op",
    saved_ops=frozenset(
        (
            "mm",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "max",
        )
    ),
    every_nth_matmul_recomputed=2,
    source=(
        "torchtitan's op-level selective activation checkpointing: its save list (mm, the SDPA efficient, flash "
        "and cuDNN kernels, max; a reduce-scatter, not in a single device's step) and its policy re-running every "
        "second mm of a block"
    ),
)
RULES = {rule.name: rule for rule in (BUILT_IN, TORCHTITAN_OP)}
"""The named rules, for ``python -m offload predict --selective-rule``."""


def get_rule(name: str) -> SelectiveRule:
    if name not in RULES:
        raise ValueError(f"unknown selective rule {name!r}; named rules are: {', '.join(RULES)}")
    return RULES[name]
