"""``regions="auto"``: find a model's repeated blocks without being told their names.

The unit a policy decides on is a model's repeated block (a transformer layer, a residual stage).
Two rules, in order:

1. A Hugging Face model names its block classes in ``_no_split_modules`` (the classes accelerate
   must never split across devices: its decoder layers). The outermost modules of those classes
   are the regions, in the order the model lists them.
2. Otherwise, the children of every ``nn.ModuleList`` and ``nn.Sequential`` in the model are
   grouped by type, across containers: a staged CNN (a ResNet's ``layer1`` .. ``layer4``, two
   residual blocks each, wider stage by stage) is one group of eight blocks, not four of two; the
   first stages, narrow in parameters, save most of the activation bytes. A type with at least
   ``MIN_BLOCKS`` such children is a candidate (the outermost where one holds another); the one
   whose blocks hold the most parameters wins (the more blocks on a tie, then the first found).

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


def _stacks(model: torch.nn.Module) -> list[tuple[int, list[str], list[tuple[str, torch.nn.Module]]]]:
    """(parameters, container names, blocks) for every module type of which ``MIN_BLOCKS`` or more
    modules are children of an ``nn.ModuleList`` or ``nn.Sequential``: all of them, whichever
    container holds them (a staged CNN's residual blocks, two in each of four stages), the
    outermost where one holds another of its type."""
    by_type: dict[type, dict[str, list[tuple[str, torch.nn.Module]]]] = {}
    for name, container in model.named_modules():  # each module once, where first reached
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        for child_name, child in container.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            by_type.setdefault(type(child), {}).setdefault(name, []).append((qualified, child))
    stacks = []
    for in_containers in by_type.values():
        blocks: list[tuple[str, torch.nn.Module]] = []
        seen: set[int] = set()
        for qualified, block in (b for group in in_containers.values() for b in group):
            if id(block) in seen or any(qualified.startswith(outer + ".") for outer, _ in blocks):
                continue  # shared with another container, or inside a block of its type
            seen.add(id(block))
            blocks.append((qualified, block))
        if len(blocks) >= MIN_BLOCKS:
            kept = {id(m) for _, m in blocks}
            containers = [c for c, group in in_containers.items() if any(id(m) in kept for _, m in group)]
            stacks.append((sum(_parameters(m) for _, m in blocks), containers, blocks))
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
    params, containers, blocks = max(stacks, key=lambda s: (s[0], len(s[2])))
    kind = type(blocks[0][1]).__name__
    where = ", ".join(c or "the model" for c in containers)
    return Found(
        blocks,
        f"regions='auto': {len(blocks)} × {kind} in {where} ({params / total:.0%} of the parameters), the "
        f"block type holding the most parameters among the children of nn.ModuleList and nn.Sequential",
    )
