"""The built-in MiniGPT and its corpus: shapes, init, config validation, determinism."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from offload.models import Block, GPTConfig, MiniGPT, batches, load_corpus
from offload.models import corpus as corpus_module
from offload.models.gpt import Rotary

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16)
"""A model small enough that every test here runs in milliseconds."""

INIT_LOSS_TOL = 0.25
"""How far the loss at init may sit from ln(vocab_size): the tied, std-0.02 head gives
near-uniform logits, so cross-entropy is ln(256) plus a few hundredths."""

SDPA_VS_MATH_ATOL = 1e-5
"""Fused and explicit attention differ only by float32 rounding order."""

CORPUS_BYTES = 200_000
"""Corpus size for tests: enough windows, fast to read."""


def _model(config: GPTConfig = SMALL, seed: int = 0) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(config)


def _tokens(config: GPTConfig = SMALL, batch_size: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(config.vocab_size, (batch_size, config.seq_len), generator=generator)


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(max_bytes=CORPUS_BYTES)


def test_logits_shape_and_no_loss_without_targets():
    idx = _tokens()
    logits, loss = _model()(idx)
    assert logits.shape == (3, SMALL.seq_len, SMALL.vocab_size)
    assert loss is None


def test_loss_at_init_is_near_uniform():
    idx = _tokens()
    _, loss = _model()(idx, torch.roll(idx, -1, dims=1))
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(SMALL.vocab_size)) < INIT_LOSS_TOL


def test_output_head_is_tied_to_embedding():
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    with torch.no_grad():
        model.wte.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0].item() == 123.0
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once, as the embedding
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_blocks_are_a_module_list_of_blocks():
    model = _model()
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == SMALL.n_layer
    assert all(isinstance(block, Block) for block in model.blocks)


def test_rotary_buffers_are_not_in_state_dict():
    keys = _model().state_dict().keys()
    assert not any(key.endswith(("cos", "sin", "causal_mask")) for key in keys)


def test_rotary_tables_are_the_angles_cos_and_sin_rounded_once():
    """The tables are double precision's cos and sin rounded to float32 once (torch's float32 cos
    misses that at some angles, and its first call in a process could read another result)."""
    rotary = Rotary(32, 512)
    positions = torch.arange(512, dtype=torch.float64)
    inv_freq = torch.tensor([10_000.0 ** (-i / 32) for i in range(0, 32, 2)], dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    assert torch.equal(rotary.cos, angles.cos().float()) and torch.equal(rotary.sin, angles.sin().float())


@pytest.mark.slow  # spawns processes
def test_every_process_builds_the_same_model():
    """A model built in one process equals the same model built in another: a benchmark compares
    configurations each run in a process of its own. Each process builds MiniGPT's rotary tables
    first thing (torch's first float32 cos in a process was where they parted) and a second time."""
    code = (
        "import hashlib, torch\n"
        "from offload.models.gpt import Rotary\n"
        "a, b = Rotary(64, 256), Rotary(64, 256)\n"
        "assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin), 'two builds in one process differ'\n"
        "print(hashlib.sha1(a.cos.numpy().tobytes() + a.sin.numpy().tobytes()).hexdigest())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # the first cos parted only with more than one thread
    # One after another: run side by side on two cores, the old tables parted far less often.
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        for _ in range(12)
    ]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs if run.returncode]
    assert len({run.stdout for run in runs}) == 1, [run.stdout.strip() for run in runs]


def test_same_seed_same_weights():
    a, b = _model(seed=7), _model(seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"n_embd": 130, "n_head": 4}, "n_embd=130"),
        ({"n_embd": 12, "n_head": 4}, "odd"),
        ({"n_layer": 0}, "n_layer=0"),
        ({"vocab_size": -1}, "vocab_size=-1"),
        ({"seq_len": 2.5}, "seq_len=2.5"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"mlp_ratio": 0}, "mlp_ratio=0"),
        ({"attention": "flash"}, "'flash'"),
    ],
)
def test_config_validation_names_the_field_and_value(overrides, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        GPTConfig(**overrides)


def test_unknown_attention_lists_the_choices():
    with pytest.raises(ValueError) as error:
        GPTConfig(attention="flash")
    assert "'sdpa'" in str(error.value) and "'math'" in str(error.value)


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.n_layer = 3
    with pytest.raises(TypeError):
        GPTConfig(256)


def test_swiglu_hidden_width():
    assert GPTConfig(n_embd=128).mlp_hidden == 344  # int(2/3 * 512) = 341, rounded up to a multiple of 8


def test_too_long_input_is_rejected():
    with pytest.raises(ValueError, match="seq_len=16"):
        _model()(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_sdpa_and_math_attention_agree_in_eval():
    config_math = dataclasses.replace(SMALL, attention="math", dropout=0.1)
    config_sdpa = dataclasses.replace(config_math, attention="sdpa")
    model_math, model_sdpa = _model(config_math).eval(), _model(config_sdpa).eval()
    idx = _tokens()
    logits_math, _ = model_math(idx)
    logits_sdpa, _ = model_sdpa(idx)
    torch.testing.assert_close(logits_sdpa, logits_math, atol=SDPA_VS_MATH_ATOL, rtol=0)


def test_causality_future_tokens_do_not_change_past_logits():
    for attention in ("sdpa", "math"):
        model = _model(dataclasses.replace(SMALL, attention=attention)).eval()
        idx = _tokens(batch_size=1)
        changed = idx.clone()
        changed[0, -1] = (changed[0, -1] + 1) % SMALL.vocab_size
        torch.testing.assert_close(model(idx)[0][:, :-1], model(changed)[0][:, :-1], atol=0, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_backward_reaches_every_parameter(attention):
    model = _model(dataclasses.replace(SMALL, attention=attention, dropout=0.1)).train()
    idx = _tokens()
    _, loss = model(idx, torch.roll(idx, -1, dims=1))
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_math_attention_backward_is_bitwise_reproducible():
    grads = []
    for _ in range(2):
        model = _model(dataclasses.replace(SMALL, attention="math"))
        idx = _tokens()
        model(idx, torch.roll(idx, -1, dims=1))[1].backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_corpus_is_bytes_within_limit(corpus):
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1
    assert corpus.numel() == CORPUS_BYTES  # the stdlib holds far more than this


def test_corpus_falls_back_to_package_source(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_module, "_stdlib_dir", lambda: tmp_path / "missing")
    package_bytes = sum(p.stat().st_size for p in corpus_module._package_dir().rglob("*.py"))
    if package_bytes < corpus_module.MIN_CORPUS_BYTES:
        with pytest.raises(RuntimeError, match="no training text found"):
            load_corpus()
    else:
        assert load_corpus().numel() == min(package_bytes, corpus_module.DEFAULT_MAX_BYTES)


def test_corpus_with_no_source_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_module, "_stdlib_dir", lambda: tmp_path / "missing")
    monkeypatch.setattr(corpus_module, "_package_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="no training text found"):
        load_corpus()


def test_batches_are_shifted_int64_pairs(corpus):
    x, y = next(batches(corpus, 4, 32, torch.Generator().manual_seed(0)))
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_are_deterministic_for_a_seed(corpus):
    def take(seed: int) -> list[torch.Tensor]:
        stream = batches(corpus, 4, 32, torch.Generator().manual_seed(seed))
        return [t for pair in itertools.islice(stream, 3) for t in pair]

    assert all(torch.equal(a, b) for a, b in zip(take(1), take(1), strict=True))
    assert not torch.equal(take(1)[0], take(2)[0])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"batch_size": 0}, ValueError),
        ({"seq_len": 10**9}, ValueError),
        ({"generator": 0}, TypeError),
    ],
)
def test_batches_validates_arguments_at_call_time(corpus, kwargs, error):
    arguments = {"batch_size": 2, "seq_len": 8, "generator": torch.Generator()} | kwargs
    with pytest.raises(error):
        batches(corpus, **arguments)


def test_model_trains_on_corpus(corpus):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = batches(corpus, 8, SMALL.seq_len, torch.Generator().manual_seed(0))
    losses = []
    for x, y in itertools.islice(stream, 30):
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
