"""Small models and the reference-comparison helpers the engine tests share.

Every behaviour test here has one oracle: the same model, built from the same seed, run without
the engine. ``run_step`` runs one forward and backward (optionally under an engine) and returns
everything that must come out bitwise equal: the output, every parameter's gradient, the input's
gradient and every buffer (BatchNorm running stats). ``assert_same`` compares two of those with
``torch.equal`` and names what differs.

Models are built once per seed and copied with ``copy.deepcopy`` so a reference and an engine run
start from identical weights; the RNG is reseeded before each forward so dropout masks match.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import offload

MB = 1 << 20

FORWARD_SEED = 1234
"""Seed set right before each forward (dropout masks) and before each input is drawn."""

SETTLE_TIMEOUT_S = 5.0
"""How long a spill write still in flight may take to land before 'nothing left behind' fails.
Releases of entries whose copy is in flight finish when the copy lands; stats only polls."""


# ---------------------------------------------------------------------------------- models


def mlp(depth: int = 4, width: int = 64, *, inplace: bool = False, seed: int = 0) -> nn.Module:
    """Linear + ReLU stack; ``inplace`` uses ReLU(inplace=True) (the saved result is the in-place output)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(inplace=inplace)]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN + skip, ReLU: the CNN building block (BatchNorm in train mode)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + x)


def cnn(channels: int = 8, blocks: int = 2, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        *[ResBlock(channels) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )


def gpt(*, dropout: float = 0.1, attention: str = "math", seed: int = 0) -> nn.Module:
    """The library's MiniGPT (RMSNorm, SwiGLU, rotary, tied head), tiny, with dropout."""
    from offload.models import GPTConfig, MiniGPT

    torch.manual_seed(seed)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, dropout=dropout, attention=attention)
    return MiniGPT(config)


def tiny_llama(*, width: int, vocab: int, longest: int, use_cache: bool = True) -> nn.Module:
    """A tiny ``transformers.LlamaForCausalLM`` (2 layers, 4 heads of which 2 key/value, MLP twice
    the width) with random weights from seed 0. The caller sets ``HF_HUB_OFFLINE=1`` and skips
    without transformers before calling: nothing is downloaded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=longest,
        use_cache=use_cache,
    )
    return transformers.LlamaForCausalLM(config)


class GPTLoss(nn.Module):
    """MiniGPT returning its loss, so it fits ``run_step``'s model(x) -> output shape."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits, loss = self.model(idx[:, :-1], idx[:, 1:])
        return loss


class Recurrent(nn.Module):
    """A GRU or LSTM over a sequence, read out by a linear head."""

    def __init__(self, kind: str, size: int = 16, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        cls = {"gru": nn.GRU, "lstm": nn.LSTM}[kind]
        self.rnn = cls(size, size, num_layers=2, batch_first=True)
        self.head = nn.Linear(size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


class Tied(nn.Module):
    """Embedding and output head share one weight; integer indices are saved by the embedding."""

    def __init__(self, vocab: int = 50, width: int = 32, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(idx))))


# ---------------------------------------------------------------------------------- running


@dataclasses.dataclass
class Result:
    """What one training step produced; two Results from the same math must be bitwise equal."""

    output: torch.Tensor
    grads: dict[str, Optional[torch.Tensor]]
    input_grad: Optional[torch.Tensor]
    buffers: dict[str, torch.Tensor]

    def __repr__(self) -> str:  # pytest prints Results on failure; the tensors would drown the message
        return f"Result(output {tuple(self.output.shape)}, {len(self.grads)} grads, {len(self.buffers)} buffers)"


def default_loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient is not uniform, so a swapped or stale saved tensor shows."""
    out = out.float()
    return (out * torch.linspace(-1.0, 1.0, out.numel()).view_as(out)).sum() + out.pow(2).mean()


def run_step(
    model: nn.Module,
    make_input: Callable[[], torch.Tensor],
    eng: Optional[offload.Engine] = None,
    *,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] = default_loss,
    input_grad: bool = True,
    autocast: Optional[torch.dtype] = None,
) -> Result:
    """One forward (under ``eng`` if given) and backward (outside it); returns what came out."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(FORWARD_SEED)
    x = make_input()
    if input_grad and x.is_floating_point():
        x.requires_grad_(True)
    torch.manual_seed(FORWARD_SEED + 1)
    with contextlib.ExitStack() as stack:
        if eng is not None:
            stack.enter_context(eng)
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=autocast))
        out = model(x)
        loss = loss_fn(out)
    loss.backward()
    return Result(
        output=out.detach().clone(),
        grads={n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        input_grad=None if x.grad is None else x.grad.clone(),
        buffers={n: b.clone() for n, b in model.named_buffers()},
    )


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    return f"max |diff| = {(a.double() - b.double()).abs().max().item():.3g}"


def assert_same(ref: Result, got: Result, what: str = "") -> None:
    """Bitwise equality of everything two steps produced, naming the first thing that differs."""
    prefix = f"{what}: " if what else ""
    assert torch.equal(ref.output, got.output), f"{prefix}output differs ({_diff(ref.output, got.output)})"
    assert ref.grads.keys() == got.grads.keys()
    for name, g_ref in ref.grads.items():
        g = got.grads[name]
        assert (g_ref is None) == (g is None), f"{prefix}grad of {name}: one is None"
        if g_ref is not None:
            assert torch.equal(g_ref, g), f"{prefix}grad of {name} differs ({_diff(g_ref, g)})"
    if ref.input_grad is not None or got.input_grad is not None:
        assert ref.input_grad is not None and got.input_grad is not None, f"{prefix}input grad: one is None"
        assert torch.equal(ref.input_grad, got.input_grad), f"{prefix}input grad differs"
    for name, b_ref in ref.buffers.items():
        b = got.buffers[name]
        assert torch.equal(b_ref, b), f"{prefix}buffer {name} differs ({_diff(b_ref, b)})"


def saved_bytes(model: nn.Module, make_input, **step_kwargs) -> int:
    """Bytes of distinct storages the engine manages for one step of ``model`` (budget None)."""
    eng = offload.engine(None, min_offload_mb=0)
    run_step(copy.deepcopy(model), make_input, eng, **step_kwargs)
    nbytes = eng.stats.saved_bytes
    eng.close()
    assert nbytes > 0, "the model saved nothing the engine could manage; the test would prove nothing"
    return nbytes


# ---------------------------------------------------------------------------------- cleanliness


def files_under(path: Path) -> list[str]:
    return [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]


def spill_files(spill_dir: Path) -> list[str]:
    """The engine's spill files made under ``spill_dir``, as ``/proc/self/fd/N``: open and nameless
    (``offload._memory.spill``, Note: [the spill file has no name]), so ``spill_dir`` itself lists
    none. Stat or truncate one through its path here as the file itself."""
    found = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(spill_dir) + os.sep) and target.endswith(" (deleted)"):
            found.append(f"/proc/self/fd/{fd}")
    return found


def spill_file_name(fd_path: str) -> str:
    """The name ``fd_path``'s spill file had for the moment between its create and its unlink."""
    return os.readlink(fd_path).removesuffix(" (deleted)")


def wait_clean(eng: offload.Engine, spill_dir: Optional[Path] = None) -> offload.Stats:
    """Wait (briefly) until the engine holds nothing: no resident bytes, no spilled bytes, and in
    the spill directory nothing but the engine's one spill file (kept for reuse until ``close()``).

    Spill writes that were in flight when their tensor died are retired when they land, so give
    them ``SETTLE_TIMEOUT_S``; anything still there after that is a leak.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        gc.collect()
        stats = eng.stats
        left = files_under(spill_dir) if spill_dir is not None else []
        if stats.resident_bytes == 0 and stats.spill_bytes == 0 and len(left) <= stats.spill_files <= 1:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engine left things behind: resident_bytes={stats.resident_bytes}, spill_bytes={stats.spill_bytes}, "
                f"spill_files={stats.spill_files}, files in spill dir={left}"
            )
        time.sleep(0.01)


def budget_between(total_bytes: int, fraction: float) -> float:
    """A budget in MB that keeps about ``fraction`` of ``total_bytes`` on the device."""
    return total_bytes * fraction / MB


__all__ = [
    "GPTLoss",
    "MB",
    "Recurrent",
    "ResBlock",
    "Result",
    "Tied",
    "assert_same",
    "budget_between",
    "cnn",
    "default_loss",
    "files_under",
    "gpt",
    "mlp",
    "run_step",
    "saved_bytes",
    "wait_clean",
]


# ---------------------------------------------------------------------------------- profiling steps

_STAGE_LETTERS = {"measure": "M", "recompute": "R", "offload": "O", None: "."}


def stage_letters(stages) -> str:
    """``Engine.recent_stages`` as one letter a step: M measure, R recompute, O offload, . a plan."""
    return "".join(_STAGE_LETTERS[stage] for stage in stages)


def auto_trials(link: bool = True) -> str:
    """The trial steps "auto" may legitimately run at one fixed input shape, as a pattern over
    ``stage_letters``: a round is a "recompute" trial and, with a link, an "offload" trial after
    it (run again where its reading was implausible: ``calibration_tries`` in all); where the noise
    decides the plan the round runs again, ``max_trial_rounds`` in all (``offload.limits``). How
    many depends on how noisy the steps ran, so tests accept each."""
    CALIBRATION_TRIES, MAX_TRIAL_ROUNDS = offload.limits.calibration_tries, offload.limits.max_trial_rounds
    if not link:
        return f"R{{1,{MAX_TRIAL_ROUNDS}}}"
    # A round repeated after every reading of the first was implausible calibrates nothing: the
    # probe's figures stand (``Profiler._round_done``), so it is a "recompute" trial alone.
    first, again = f"RO{{1,{CALIBRATION_TRIES}}}", f"RO{{0,{CALIBRATION_TRIES}}}"
    return f"{first}(?:{again}){{0,{MAX_TRIAL_ROUNDS - 1}}}"


def most_profiling_steps(policy: str, *, shapes: int = 1, link: bool = True) -> int:
    """The profiling steps one family of inputs may legitimately take under ``policy``, ``shapes``
    of them measured, read off the rules ``offload.limits`` states: at its first inputs up to
    ``profile_steps`` "measure" steps (a second where the first's plan moved nothing); a "recompute"
    trial at each shape measured (``max_measured_shapes`` at most); under "auto" the first trial
    round again where the noise decides the plan (``max_trial_rounds`` rounds), and with a link an
    "offload" trial per round, plus one more for each implausible reading while none was accepted
    (``calibration_tries``). "offload" plans from sizes alone: its "measure" steps only."""
    limits = offload.limits
    CALIBRATION_TRIES, MAX_MEASURED_SHAPES = limits.calibration_tries, limits.max_measured_shapes
    MAX_TRIAL_ROUNDS, PROFILE_STEPS = limits.max_trial_rounds, limits.profile_steps
    measured = min(shapes, MAX_MEASURED_SHAPES)
    if policy == "offload":
        return PROFILE_STEPS
    if policy == "selective":
        return PROFILE_STEPS + measured
    if policy == "auto":
        recompute = MAX_TRIAL_ROUNDS + measured - 1
        calibrate = MAX_TRIAL_ROUNDS + CALIBRATION_TRIES - 1 if link else 0
        return PROFILE_STEPS + recompute + calibrate
    return 0
