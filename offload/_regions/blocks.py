"""``regions="auto"``: find a model's repeated blocks without being told their names.

The unit a policy decides on is a model's repeated block (a transformer layer, a residual stage).
Two rules, in order:

1. A Hugging Face model names its block classes in ``_no_split_modules`` (the classes accelerate
   must never split across devices: its decoder layers). The outermost modules of those classes
   are the regions, in the order the model lists them.
2. Otherwise, every ``nn.ModuleList`` and ``nn.Sequential`` in the model is a candidate: its
   children of the one type that holds the most parameters among them, where at least
   ``MIN_BLOCKS`` children share it. The candidate whose blocks hold the most parameters wins (the
   longer on a tie, then the first found): the stack that holds most of the model.

What was chosen, and by which rule, is said in ``Found.why`` (``explain()`` prints it). A model
with no repeated block gets a ``ValueError`` that says what to pass instead. The rules read the
model's structure (classes, containers, parameter counts), never attribute names.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["MIN_BLOCKS", "Found", "find_blocks"]

MIN_BLOCKS = 2
"""Fewest children of one type that make a stack of blocks."""


@dataclasses.dataclass(frozen=True)
class Found:
    """The blocks found: (qualified name, module) pairs, and why these."""

    regions: list[tuple[str, torch.nn.Module]]
    why: str


def _parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _by_class_names(model: torch.nn.Module, class_names: set[str]) -> list[tuple[str, torch.nn.Module]]:
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not name or type(module).__name__ not in class_names:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # inside a block already found
        found.append((name, module))
    return found


def _stacks(model: torch.nn.Module) -> list[tuple[int, str, list[tuple[str, torch.nn.Module]]]]:
    """(parameters, container name, blocks) for every container holding ``MIN_BLOCKS`` or more
    children of one type (the type among them with the most parameters)."""
    stacks = []
    for name, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        by_type: dict[type, list[tuple[str, torch.nn.Module]]] = {}
        for child_name, child in container.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            by_type.setdefault(type(child), []).append((qualified, child))
        groups = [g for g in by_type.values() if len(g) >= MIN_BLOCKS]
        if not groups:
            continue
        blocks = max(groups, key=lambda g: (sum(_parameters(m) for _, m in g), len(g)))
        stacks.append((sum(_parameters(m) for _, m in blocks), name, blocks))
    return stacks


def find_blocks(model: torch.nn.Module) -> Found:
    """The repeated blocks of ``model`` (see the module docstring); ``ValueError`` if it has none."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"regions='auto' searches an nn.Module, got {type(model).__name__}; pass model=")
    total = max(1, _parameters(model))
    class_names: Optional[list] = getattr(model, "_no_split_modules", None)
    if class_names:
        found = _by_class_names(model, set(class_names))
        if len(found) >= MIN_BLOCKS:
            share = sum(_parameters(m) for _, m in found) / total
            kinds = ", ".join(sorted({type(m).__name__ for _, m in found}))
            return Found(
                found,
                f"regions='auto': {len(found)} × {kinds} ({found[0][0]} .. {found[-1][0]}, {share:.0%} of the "
                f"parameters), the block classes the model names in _no_split_modules",
            )
    stacks = _stacks(model)
    if not stacks:
        raise ValueError(
            f"regions='auto' found no repeated block in {type(model).__name__}: no nn.ModuleList or nn.Sequential "
            f"holds {MIN_BLOCKS} or more children of one type; pass the blocks yourself, e.g. regions=[model.a, "
            f"model.b], or a filter regions=lambda module, name: ... with model=; or leave regions out: the engine "
            f"then offloads saved tensors under the budget without planning blocks (policy='offload')"
        )
    params, container, blocks = max(stacks, key=lambda s: (s[0], len(s[2])))
    kind = type(blocks[0][1]).__name__
    return Found(
        blocks,
        f"regions='auto': {len(blocks)} × {kind} in {container or 'the model'} ({params / total:.0%} of the "
        f"parameters), the longest stack of one block type holding the most parameters",
    )
