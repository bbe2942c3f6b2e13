"""Regions on CUDA: recompute and selective with CUDA RNG (dropout) and flash attention, bitwise.

Every test here needs a CUDA device and is skipped cleanly without one. A recomputed region must
replay the CUDA generator exactly: dropout on the embeddings and residual branches, and inside
flash attention (its dropout draws from the same Philox generator, by seed and offset). Flash
attention's backward is deterministic only under ``torch.use_deterministic_algorithms(True)``
(not ``warn_only``): ATen's ``_flash_attention_backward`` passes ``deterministic`` to the kernel
from that flag alone. So both runs are strict, cuBLAS gets its workspace setting (tests/conftest.py
sets it before CUDA starts), and new memory is NaN-filled: a region recomputed into the wrong
buffers, or a stash used before its copy landed, shows as NaN. The loss is computed from
``log_softmax`` (strict mode has no deterministic ``F.cross_entropy`` on CUDA).

Oracle: the same model without the engine, every profiling and planned step, bitwise (loss and
every parameter's gradient), in bf16 (flash attention takes bf16 or fp16).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import offload
from offload.models.gpt import GPTConfig, MiniGPT
from test_regions import MACHINE
from zoo import wait_clean

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = GPTConfig(n_layer=3, n_head=4, n_embd=256, seq_len=512, dropout=0.1, attention="sdpa")
"""Head width 64 and bf16: inside flash attention's limits on every GPU that has it."""
BATCH = 4
STEPS = 4
"""Profiling steps ("measure", "recompute") and then steps under the plan."""
SEED = 1234


@contextlib.contextmanager
def _strict_flash():
    """Strict determinism (new memory NaN-filled) and SDPA restricted to flash attention: no other
    kernel may stand in for it (SDPA raises if flash cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _model() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CONFIG).cuda().to(torch.bfloat16).train()


def _step(model: MiniGPT, step: int, eng=None) -> list[torch.Tensor]:
    """One step's loss and gradients; the batch and the dropout masks depend on ``step`` only."""
    g = torch.Generator().manual_seed(SEED + step)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=g).cuda()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED + 100 + step)  # every device's generator: the CUDA one draws the dropout masks
    with eng if eng is not None else contextlib.nullcontext():
        logits, _ = model(idx[:, :-1])
        loss = -logits.float().log_softmax(-1).gather(-1, idx[:, 1:].unsqueeze(-1)).mean()
    loss.backward()
    torch.cuda.synchronize()
    return [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]


def _assert_same(want: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert torch.equal(want[0], got[0]), f"{what}: loss {got[0].item()} != {want[0].item()}"
    for i, (a, b) in enumerate(zip(want[1:], got[1:], strict=True)):
        assert not torch.isnan(b).any(), f"{what}: gradient {i} has NaN (memory used before it was written)"
        assert torch.equal(a, b), f"{what}: gradient {i} differs by {(a.float() - b.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("budget_mb", [None, 0], ids=["keep", "budget=0"])
@pytest.mark.parametrize("policy", ["recompute", "selective"])
def test_regions_with_cuda_dropout_and_flash_attention_equal_no_engine(policy, budget_mb, spill_dir):
    model = _model()
    reference = copy.deepcopy(model)
    eng = offload.engine(
        budget_mb, policy=policy, regions=model.blocks, model=model, machine=MACHINE, spill_dir=spill_dir
    )
    with _strict_flash():
        for step in range(STEPS):
            _assert_same(_step(reference, step), _step(model, step, eng), f"{policy}, budget {budget_mb}, step {step}")
    stats = wait_clean(eng, spill_dir)
    assert stats.recomputed_regions > 0, "regions were recomputed (the path under test)"
    if budget_mb == 0:
        assert stats.offloaded_bytes > 0, "what the regions keep moved through the host tier"
    eng.close()
