"""The trainers' and metrics' examples of the README and of docs/trainers.md run as written, each
with the names its ``# supply:`` line assumes prepared.

They are fenced ```py, not ```python: ``test_readme.py`` runs every ```python block of a page in
one namespace without the optional frameworks, and these need transformers / lightning /
accelerate / prometheus-client and a model of the framework's kind. Each is skipped when its
framework is absent.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import offload  # noqa: E402
from doc_blocks import ROOT, py_blocks  # noqa: E402

TRAINERS = {"README.md": "## Trainers", "docs/trainers.md": None}
"""Where the trainers' examples are: the README's Trainers section, and the whole trainers page."""


def trainers_block(page: str, needle: str) -> str:
    """The one ```py trainers example of ``page`` that contains ``needle``."""
    found = py_blocks(page, section=TRAINERS[page], needle=needle)
    assert len(found) == 1, f"expected one example with {needle!r} in {page}, found {len(found)}"
    return found[0]


def run(page: str, block: str, **names) -> dict:
    namespace = {"offload": offload, **names}
    exec(compile(block, str(ROOT / page), "exec"), namespace)
    return namespace


pages = pytest.mark.parametrize("page", list(TRAINERS))


@pages
def test_hf_example(page, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_integrations_hf import Tokens, arguments, llama

    model = llama()
    namespace = run(
        page, trainers_block(page, "integrations.hf"), model=model, args=arguments(tmp_path), train_data=Tokens(4)
    )
    assert isinstance(namespace["trainer"], transformers.Trainer)
    assert "saved_tensors=" in capsys.readouterr().out
    assert "forward" not in model.__dict__


@pages
def test_lightning_example(page, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lightning")
    from test_integrations_lightning import MLP, data

    monkeypatch.chdir(tmp_path)  # lightning writes its logs under the working directory
    run(page, trainers_block(page, "integrations.lightning"), module=MLP(), train_loader=data())
    assert "saved_tensors=" in capsys.readouterr().out


@pages
def test_accelerate_example(page):
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    loader = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    namespace = run(
        page,
        trainers_block(page, "Accelerator"),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=loader,
        loss_fn=torch.nn.functional.mse_loss,
    )
    assert namespace["eng"].stats.passthrough_tensors > 0  # the forwards went through the engine's hooks


def test_metrics_example():
    prometheus_client = pytest.importorskip("prometheus_client")
    from offload.models import GPTConfig, MiniGPT

    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, seq_len=32, attention="math"))
    batches = [(torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))) for _ in range(2)]
    registry = prometheus_client.CollectorRegistry()
    eng = offload.engine(budget_mb=0)
    (block,) = py_blocks("docs/trainers.md", section="## Metrics")
    try:
        run("docs/trainers.md", block, eng=eng, model=model, batches=batches, registry=registry)
    finally:
        eng.close()
    assert registry.get_sample_value("offload_saved_bytes_total") > 0
