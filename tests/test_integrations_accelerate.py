"""A loop under ``accelerate``: ``Accelerator().prepare(model, optimizer)`` around the engine.

No integration code is needed: the prepared model's forward goes under ``with eng:`` as in any
loop, and ``accelerator.backward(loss)`` runs after it. The built-in MiniGPT (dropout on, so the
forward's RNG draws are compared too) is trained on the CPU with and without the engine, same
seeds, with accelerate's gradient accumulation: losses and final weights bitwise equal, every
byte saved at budget 0 moved and brought back, no spill file left after close. Skipped without
accelerate (``pip install -e '.[hf]'``; ``make test`` installs it).
"""

from __future__ import annotations

import copy

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import offload  # noqa: E402
from offload.models.gpt import GPTConfig, MiniGPT  # noqa: E402
from zoo import files_under, wait_clean  # noqa: E402

BATCH, SEQ = 2, 32
MICRO_BATCHES = 6
ACCUMULATION = 2
"""Three optimizer steps of two micro-batches each."""
SEED = 1234
MIN_OFFLOAD_BYTES = 1024
"""Below the default 64 KiB so this model's activations (2 x 32 x 32 fp32 = 8 KiB) move."""


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, seq_len=SEQ, dropout=0.1, attention="math"))


def train(model: torch.nn.Module, eng=None) -> list[torch.Tensor]:
    """The usual accelerate loop; ``eng`` (if given) around each forward. Returns each micro-batch's loss."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    model.train()
    losses = []
    for step in range(MICRO_BATCHES):
        torch.manual_seed(SEED + step)  # the batch and the dropout masks
        x = torch.randint(0, 256, (BATCH, SEQ))
        with accelerator.accumulate(model):
            if eng is None:
                _, loss = model(x, x)
            else:
                with eng:
                    _, loss = model(x, x)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def test_accelerate_loop_equal_with_engine(spill_dir):
    base = gpt()
    reference = copy.deepcopy(base)
    reference_losses = train(reference)

    model = copy.deepcopy(base)
    eng = offload.engine(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir, model=model)
    losses = train(model, eng)

    assert all(torch.equal(a, b) for a, b in zip(reference_losses, losses, strict=True))
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), f"final {name} differs"
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_tensors > 0 and stats.offloaded_bytes > 0
    assert stats.offloaded_bytes == stats.saved_bytes  # budget 0: everything eligible moved
    assert stats.reloaded_bytes > 0  # and came back for backward (once per storage, or again for a user far apart)
    eng.close()
    assert files_under(spill_dir) == []
