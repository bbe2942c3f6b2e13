"""``regions="auto"``: the engine finds a model's repeated blocks itself.

Oracle: the blocks a person would name (``model.blocks`` of the built-in MiniGPT, a Hugging Face
model's decoder layers, the residual blocks of a CNN); what was found is said in ``explain()``;
a model without repeated blocks gets an error that says what to pass. The engine over the blocks
found trains bitwise like the model without it.
"""

from __future__ import annotations

import copy
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
            self.small = nn.ModuleList(nn.LayerNorm(2) for _ in range(6))
            self.big = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    assert names(Found(Model())) == ["big.0", "big.1", "big.2"]


def test_one_block_type_in_several_containers_is_one_group():
    """Blocks of one type are found together whichever container holds them: both lists here."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.narrow = nn.ModuleList(nn.Linear(2, 2) for _ in range(6))
            self.wide = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    found = Found(Model())
    assert names(found) == [f"narrow.{i}" for i in range(6)] + [f"wide.{i}" for i in range(3)]
    assert "9 × Linear in narrow, wide" in found.why, found.why


class BasicBlock(nn.Module):
    """torchvision's ResNet block: conv-BN-ReLU-conv-BN, plus the input (through a strided 1x1
    conv and BN where the stage narrows the image and widens the channels), ReLU."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.downsample(x))


class ResNet(nn.Module):
    """torchvision's ResNet-18 in shape, small: a stem, then ``layer1`` .. ``layer4`` of two
    blocks each, each stage twice the channels at half the resolution of the one before, so the
    first stages hold few parameters and save most of the activation bytes."""

    def __init__(self, width: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        widths = [width, 2 * width, 4 * width, 8 * width]
        channels_in = width
        for stage, channels in enumerate(widths, start=1):
            stride = 1 if stage == 1 else 2
            layer = nn.Sequential(BasicBlock(channels_in, channels, stride), BasicBlock(channels, channels, 1))
            self.add_module(f"layer{stage}", layer)
            channels_in = channels
        self.fc = nn.Linear(channels_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        return self.fc(x.mean(dim=(2, 3)))


RESNET_BLOCKS = [f"layer{stage}.{i}" for stage in range(1, 5) for i in range(2)]


def test_a_staged_resnet_gives_every_residual_block():
    """Not only ``layer4``'s two (the most parameters, the fewest activation bytes): all eight."""
    found = Found(ResNet())
    assert names(found) == RESNET_BLOCKS
    assert "8 × BasicBlock in layer1, layer2, layer3, layer4" in found.why, found.why


def _train_resnet(model: nn.Module, eng=None, steps: int = 4) -> list[list[torch.Tensor]]:
    """``steps`` SGD steps; after each, the loss, every gradient and every buffer (BatchNorm's
    running statistics and its count of batches)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(steps):
        torch.manual_seed(SEED + step)
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        if eng is None:
            loss = nn.functional.cross_entropy(model(x), y)
        else:
            with eng:
                loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        history.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history[-1] += [b.clone() for b in model.buffers()]
    return history


@pytest.mark.parametrize("policy", ["auto", "recompute", "selective"])
def test_engine_over_a_resnets_blocks_trains_exactly(policy, spill_dir):
    torch.manual_seed(0)
    base = ResNet()
    reference = _train_resnet(copy.deepcopy(base))
    model = copy.deepcopy(base)
    eng = offload.engine(
        0, regions="auto", model=model, policy=policy, machine=MACHINE, min_offload_mb=0, spill_dir=spill_dir
    )
    history = _train_resnet(model, eng)
    assert [name for name, _ in eng.regions] == RESNET_BLOCKS
    assert eng.stats.saved_bytes > 0 and eng.stats.recomputed_regions > 0, eng.stats
    eng.close()
    for step, (got, want) in enumerate(zip(history, reference, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"policy {policy}: tensor {i} (loss, grads, buffers) differs at step {step}"


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
