"""The README's "Trainers" examples run as written, each with the names it assumes prepared.

They are fenced ```py, not ```python: ``test_readme.py`` runs every ```python block in one
namespace without the optional frameworks, and these need transformers / lightning / accelerate
and a model of the framework's kind. Each is skipped when its framework is absent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import offload  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def trainers_block(needle: str) -> str:
    """The one ```py block of the README's Trainers section that contains ``needle``."""
    section = README.read_text().split("## Trainers", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```py\n(.*?)```", section, flags=re.S) if needle in b]
    assert len(blocks) == 1, f"expected one Trainers example with {needle!r}, found {len(blocks)}"
    return blocks[0]


def run(block: str, **names) -> dict:
    namespace = {"offload": offload, **names}
    exec(compile(block, str(README), "exec"), namespace)
    return namespace


def test_hf_example(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_integrations_hf import Tokens, arguments, llama

    model = llama()
    namespace = run(trainers_block("integrations.hf"), model=model, args=arguments(tmp_path), train_data=Tokens(4))
    assert isinstance(namespace["trainer"], transformers.Trainer)
    assert "saved_tensors=" in capsys.readouterr().out
    assert "forward" not in model.__dict__


def test_lightning_example(tmp_path, capsys, monkeypatch):
    pytest.importorskip("lightning")
    from test_integrations_lightning import MLP, data

    monkeypatch.chdir(tmp_path)  # lightning writes its logs under the working directory
    run(trainers_block("integrations.lightning"), module=MLP(), train_loader=data())
    assert "saved_tensors=" in capsys.readouterr().out


def test_accelerate_example():
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    loader = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    namespace = run(
        trainers_block("Accelerator"),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=loader,
        loss_fn=torch.nn.functional.mse_loss,
    )
    assert namespace["eng"].stats.passthrough_tensors > 0  # the forwards went through the engine's hooks
