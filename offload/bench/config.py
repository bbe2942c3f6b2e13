"""What the step benchmark runs: its configurations, model and loop settings, and presets.

Pure data, no work: ``step`` runs it, ``report`` tables and plots what came out.

    Variant      one way of handling saved activations: none, checkpoint, save_on_cpu, or the
                 engine with a policy and a budget (a share of the reference's saved bytes)
    RunSettings  model shape and loop (steps, dtype, device, seed), shared by every configuration
    PRESETS      named settings + configuration lists (demo, h200)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

from offload.models import GPTConfig

__all__ = ["DTYPES", "MB", "PRESETS", "REFERENCE", "VARIANTS", "Kind", "Preset", "RunSettings", "Variant"]

MB = 1 << 20
"""Bytes per MB, as ``offload.engine(budget_mb=...)`` counts them."""


class Kind(enum.Enum):
    """How a configuration handles saved activations."""

    NONE = "none"
    CHECKPOINT = "checkpoint"
    SAVE_ON_CPU = "save_on_cpu"
    ENGINE = "engine"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of the benchmark."""

    name: str
    kind: Kind
    policy: Optional[str] = None
    """The engine's policy (ENGINE only)."""
    budget_fraction: Optional[float] = None
    """Budget as a share of the reference's saved activation bytes; None: no budget."""


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("none", Kind.NONE),
        Variant("checkpoint", Kind.CHECKPOINT),
        Variant("save_on_cpu", Kind.SAVE_ON_CPU),
        Variant("offload-50%", Kind.ENGINE, "offload", 0.50),
        Variant("offload-25%", Kind.ENGINE, "offload", 0.25),
        Variant("auto-50%", Kind.ENGINE, "auto", 0.50),
        Variant("auto-25%", Kind.ENGINE, "auto", 0.25),
        Variant("recompute", Kind.ENGINE, "recompute", None),
    )
}
"""Every configuration, by name, in the order they run and are tabled."""

REFERENCE = "none"
"""The configuration every other one is compared against (time ratio, losses)."""

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
    """Steps trained first and recorded, but not timed: the engine's regions profile on up to three
    (policy "auto"; see offload._regions). A step that still profiles after these is not timed either."""
    dtype: str = "fp32"
    device: str = "cpu"
    attention: str = "sdpa"
    dropout: float = 0.1
    """Nonzero so that recompute must replay the RNG exactly for the losses to match."""
    seed: int = 1234
    min_offload_bytes: Optional[int] = None
    """Passed to the engine; None: the engine's default."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms(True, warn_only=True)``: on CUDA, atomics in some
    backward kernels (attention's dq) otherwise make even two runs of the reference differ after
    the first step, and the losses-match column would say nothing about the engine."""
    spill_dir: Optional[str] = None

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
    """A named starting point: settings (overridable flag by flag) and the configurations to run."""

    settings: dict
    variants: tuple[str, ...]
    help: str


PRESETS: dict[str, Preset] = {
    "demo": Preset(
        # The "math" attention path: the CPU's fused SDPA kernel with dropout gave losses differing
        # at 1e-6 between processes even with no engine at all, hiding whether the engine is exact.
        dict(layers=4, hidden=256, heads=4, seq=256, batch=4, steps=3, warmup=3, dtype="fp32", device="cpu",
             attention="math"),
        ("none", "checkpoint", "save_on_cpu", "offload-25%", "auto-25%"),
        "CPU, five configurations, a few minutes at most on 2 cores",
    ),
    "h200": Preset(
        dict(
            layers=4, hidden=4096, heads=32, seq=4096, batch=1, steps=3, warmup=3,
            dtype="bf16", device="cuda", attention="sdpa", deterministic=True,
        ),
        tuple(VARIANTS),
        "a 7B-class layer shape (h=4096, s=4096) x 4 blocks in bf16 on one large GPU, every configuration",
    ),
}
