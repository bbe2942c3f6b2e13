"""What the benchmark runs: its configurations (``Variant``), model and loop (``RunSettings``),
and ``PRESETS``. Pure data, no work: ``loop`` trains, ``step`` runs, ``report`` tables.

A configuration's name says what it is, so any can be asked for by name (``--configs``):
``none``, ``checkpoint``, ``save_on_cpu``, ``torchtune``, ``count`` (the engine only counting),
``<policy>`` (the engine without a budget) or ``<policy>-<percent>%`` (a share of the
reference's saved activation bytes), each optionally ``+compile``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
from typing import Optional

import torch

import offload
from offload._cost import MB  # bytes per MB, as offload.engine(budget_mb=...) counts them
from offload.models import GPTConfig

__all__ = ["DTYPES", "MB", "PRESETS", "REFERENCE", "Kind", "Preset", "RunSettings", "Variant"]
__all__ += ["CHECK_BUDGETS", "engine_variants", "parse_variant"]


class Kind(enum.Enum):
    """How a configuration handles saved activations."""

    NONE = "none"
    CHECKPOINT = "checkpoint"
    SAVE_ON_CPU = "save_on_cpu"
    TORCHTUNE = "torchtune"
    ENGINE = "engine"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of the benchmark."""

    kind: Kind
    policy: Optional[str] = None
    """The engine's policy (ENGINE only)."""
    budget_fraction: Optional[float] = None
    """Budget as a share of the reference's saved activation bytes; None: no budget."""
    compiled: bool = False
    """Each block through ``torch.compile``."""

    @property
    def name(self) -> str:
        if self.kind is not Kind.ENGINE:
            base = self.kind.value
        elif self.policy == "none":
            base = "count"
        elif self.budget_fraction is None:
            base = self.policy
        else:
            base = f"{self.policy}-{round(100 * self.budget_fraction)}%"
        return base + ("+compile" if self.compiled else "")


REFERENCE = Variant(Kind.NONE)
"""The configuration every other one is compared against (time, memory, gradients, losses)."""

_ENGINE_NAME = re.compile(r"^(?P<policy>[a-z_]+)(?:-(?P<percent>\d+(?:\.\d+)?)%)?$")


def parse_variant(name: str) -> Variant:
    """The configuration ``name`` stands for; ValueError naming the valid forms otherwise."""
    base, compiled = (name[: -len("+compile")], True) if name.endswith("+compile") else (name, False)
    kinds = {k.value: k for k in Kind if k is not Kind.ENGINE}
    if base in kinds:
        return Variant(kinds[base], compiled=compiled)
    if base == "count":
        return Variant(Kind.ENGINE, "none", compiled=compiled)
    match = _ENGINE_NAME.match(base)
    if match and match["policy"] in offload.policies() and match["policy"] != "none":
        fraction = None if match["percent"] is None else float(match["percent"]) / 100
        return Variant(Kind.ENGINE, match["policy"], fraction, compiled)
    policies = ", ".join(p for p in offload.policies() if p != "none")
    raise ValueError(
        f"unknown configuration {name!r}; valid: {', '.join(kinds)}, count, or an engine policy ({policies}) "
        f"alone or as POLICY-PERCENT% (e.g. offload-25%), each optionally with +compile"
    )


ENGINE_POLICIES = ("offload", "recompute", "auto", "selective")
"""Policies the comparisons run, in table order; one that is not registered (``offload.policies()``)
is left out, so "selective" joins the tables the day it is registered."""
PROBED_POLICIES = ("offload", "auto", "selective")
"""Policies whose engine is given the measured machine (``offload.probe``: link and disk speeds)."""

BUDGETS = (1.0, 0.5, 0.25, 0.1)
"""Budgets of the comparisons, as shares of the reference's saved activation bytes."""


def engine_variants(budgets: Iterable[float] = BUDGETS) -> tuple[Variant, ...]:
    """The engine under every registered comparison policy at every budget."""
    policies = [p for p in ENGINE_POLICIES if p in offload.policies()]
    return tuple(Variant(Kind.ENGINE, p, b) for b in budgets for p in policies)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Model shape and training loop, shared by every configuration of one benchmark run."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    batch: int = 8
    steps: int = 3
    """Measured (timed) steps per configuration."""
    warmup: int = 3
    """Steps trained first and recorded, but not timed: the engine's regions profile on three as a
    rule (policy "auto"; see offload._regions.regions), on up to seven where a link reading is measured again
    or the trials run a second round (offload._plan.profiler's Note: [a plan that holds still]). A step
    that still profiles after these is not timed either."""
    repeats: int = 1
    """Times every configuration runs, the order rotated each time; figures are medians over them."""
    dtype: str = "fp32"
    device: str = "cpu"
    attention: str = "sdpa"
    dropout: float = 0.1
    """Nonzero so that recompute must replay the RNG exactly for the gradients to match."""
    seed: int = 1234
    min_offload_bytes: Optional[int] = None
    """Passed to the engine; None: the engine's default."""
    deterministic: bool = False
    """Timed steps under ``torch.use_deterministic_algorithms(True, warn_only=True)``: on CUDA the
    losses of later steps then compare too. The first-step gradient check is always strict."""
    check_grads: bool = True
    """Before training, one step under strict determinism whose loss and gradients are compared with
    the reference's, bitwise (see ``loop._grad_check``)."""
    check_seq: Optional[int] = None
    """Sequence length of the gradient check's batch (None: ``seq``, the timed shape)."""
    spill_dir: Optional[str] = None
    """Parent of the engine's spill directory; None: a private temporary one per configuration.
    Either way the harness owns it, so the page cache its files hold is counted as memory."""

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.layers,
            n_head=self.heads,
            n_embd=self.hidden,
            seq_len=self.seq,
            dropout=self.dropout,
            attention=self.attention,
        )


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named starting point: settings (``RunSettings`` fields over its defaults, each overridable
    by its flag) and the configurations to run."""

    settings: dict
    variants: tuple[Variant, ...]
    help: str


CHECK_BUDGETS = (0.25, 0.1, 0.5, 1.0)
"""``BUDGETS`` most telling first, for the GPU presets: a run cut short by ``--time-limit-s`` skips
the end of the list, and at 100 % the engine mostly keeps (it says least about moving)."""

_BASELINES = (REFERENCE, Variant(Kind.CHECKPOINT), Variant(Kind.SAVE_ON_CPU))
_COMPARISON = _BASELINES + engine_variants(CHECK_BUDGETS) + (Variant(Kind.TORCHTUNE),)

PRESETS: dict[str, Preset] = {
    # "math" attention: the CPU's fused SDPA kernel with dropout gave losses differing at 1e-6 between
    # processes even with no engine at all, hiding whether the engine is exact.
    "demo": Preset(
        dict(
            layers=4,
            hidden=256,
            heads=4,
            seq=256,
            batch=4,
            steps=2,
            repeats=3,
            dtype="fp32",
            device="cpu",
            attention="math",
        ),
        _BASELINES + tuple(Variant(Kind.ENGINE, policy, 0.25) for policy in ("offload", "selective", "auto")),
        "CPU, six configurations of MiniGPT 4 x 256, three repeats (auto's verdict needs their spread)",
    ),
    # ~1.6B parameters (8 x 200M): estimated (not yet measured) ~75 ms of compute per step on an H200, so the ~20
    # configurations x (grad check + 3 + 2 steps) should take about a minute; gpu_check gives --time-limit-s 60 %
    # of its part's limit, so whatever the GPU's speed the part ends in time, with the least telling budgets
    # skipped. The gradient check runs at the timed shape with the timed attention kernel (flash, with dropout).
    "h200": Preset(
        dict(layers=8, hidden=4096, heads=32, seq=4096, batch=1, steps=2, dtype="bf16", device="cuda"),
        _COMPARISON,
        "a 7B-class layer shape (h=4096, s=4096) x 8 blocks in bf16 on one large GPU, every configuration",
    ),
    "tiny": Preset(
        dict(layers=3, hidden=32, heads=2, seq=16, batch=2, steps=1, dtype="fp32", device="cpu", min_offload_bytes=0),
        _COMPARISON,
        "the h200 configurations at a tiny shape: every code path of the GPU run, in under a minute (CPU or CUDA)",
    ),
    "sweep": Preset(
        dict(layers=6, hidden=256, heads=4, seq=256, batch=8, steps=4, dtype="fp32", device="cpu"),
        (REFERENCE, Variant(Kind.ENGINE, "none")) + engine_variants(),
        "CPU budget sweep: every policy at 100/50/25/10 %, auto judged against the best fixed policy",
    ),
}
