"""Dynamic padding, as fine-tuning loops do it: rows of random lengths, each batch padded to its own longest.

``bench/shapes.py``'s soak and the Trainer tests feed these to ``transformers.Trainer`` (a
``Dataset`` and a ``data_collator``); nothing here imports transformers.
"""

from __future__ import annotations

import torch

__all__ = ["Ragged", "pad_to_longest"]


class Ragged(torch.utils.data.Dataset):
    """``rows`` rows of random tokens in [1, ``vocab``) and random lengths in [``shortest``,
    ``longest``], drawn from ``seed``: the same rows on every run."""

    def __init__(self, rows: int, shortest: int, longest: int, vocab: int, seed: int = 1) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"Ragged: need 1 <= shortest <= longest, got shortest={shortest}, longest={longest}")
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(shortest, longest + 1, (rows,), generator=g)
        self.rows = [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def pad_to_longest(features: list) -> dict:
    """What Hugging Face's padding collators do: pad to the batch's longest row, mask the pad, and
    leave it out of the loss (label -100)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], mask[row, :n] = f["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
