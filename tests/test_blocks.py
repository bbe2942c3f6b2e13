"""``regions="auto"``: the engine finds a model's repeated blocks itself.

Oracle: the blocks a person would name (``model.blocks`` of the built-in MiniGPT, a Hugging Face
model's decoder layers, the residual blocks of a CNN); what was found is said in ``explain()``;
a model without repeated blocks gets an error that says what to pass. The engine over the blocks
found trains bitwise like the model without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the Hub

import pytest
import torch
from torch import nn

import offload
from test_regions import CONFIG, LR, MACHINE, SEED, assert_same_history, batch, make_model, train
from zoo import ResBlock, cnn, mlp


class Found:
    """What ``regions="auto"`` found in ``model``: the engine's regions, and why, as ``explain`` says it."""

    def __init__(self, model: nn.Module) -> None:
        eng = offload.engine(1, regions="auto", model=model, machine=MACHINE)
        self.regions = eng.regions
        (self.why,) = [line for line in offload.explain(eng).splitlines() if line.startswith("regions: ")]
        eng.close()


def names(found: Found) -> list[str]:
    return [name for name, _ in found.regions]


def test_minigpt_blocks():
    found = Found(make_model())
    assert names(found) == [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    assert "3 × Block in blocks" in found.why and "of the parameters" in found.why


def test_a_sequential_of_residual_blocks():
    found = Found(cnn(blocks=3))
    assert [type(m) for _, m in found.regions] == [ResBlock] * 3
    assert names(found) == ["1", "2", "3"]


def test_the_heavier_stack_wins_over_a_longer_light_one():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(6))
            self.big = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    assert names(Found(Model())) == ["big.0", "big.1", "big.2"]


def test_a_plain_stack_of_linears():
    found = Found(mlp(depth=4))
    assert [type(m) for _, m in found.regions] == [nn.Linear] * 5  # the head is a Linear too


def test_no_repeated_block_is_an_error_that_says_what_to_pass():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="no repeated block in Sequential.*regions=\\[model.a.*or leave regions out"):
        Found(model)


def test_auto_needs_a_model():
    eng = offload.engine(1, regions="auto")  # the model may come later: watch(), or decorating it
    with pytest.raises(ValueError, match="regions='auto' needs the model"):
        with eng:
            pass
    with pytest.raises(ValueError, match="the one name regions= takes is 'auto'"):
        offload.engine(1, regions="blocks", model=make_model())


def test_hugging_face_names_its_blocks():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=64
    )
    model = transformers.LlamaForCausalLM(config)
    found = Found(model)
    assert names(found) == [f"model.layers.{i}" for i in range(3)]
    assert "LlamaDecoderLayer" in found.why and "_no_split_modules" in found.why


def test_engine_over_the_blocks_found_trains_exactly(spill_dir):
    model = make_model()
    reference = train(make_model())
    eng = offload.engine(0, regions="auto", model=model, policy="recompute", machine=MACHINE, spill_dir=spill_dir)
    assert_same_history(train(model, eng), reference, "regions='auto'")
    assert [name for name, _ in eng.regions] == [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    assert eng.stats.recomputed_regions == CONFIG.n_layer
    eng.close()


def test_decorating_the_model_finds_its_blocks(spill_dir):
    model = make_model()
    reference = train(make_model())
    eng = offload.engine(0, regions="auto", policy="recompute", machine=MACHINE, spill_dir=spill_dir)
    eng(model)  # the module's forward, under the engine; its blocks are searched now
    history = []
    for step in range(3):
        history += _plain_step(model, step)
    assert_same_history(history, reference[:3], "decorated, regions='auto'")
    assert len(eng.regions) == CONFIG.n_layer
    eng.close()


def _plain_step(model, step):
    """One step of ``test_regions.train`` with the engine entered by the decorated forward."""
    x, y = batch(CONFIG.seq_len, step)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED + step)
    _, loss = model(x, y)
    loss.backward()
    out = [(loss.detach(), [p.grad.clone() for p in model.parameters()])]
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return out
