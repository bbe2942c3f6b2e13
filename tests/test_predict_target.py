"""What the fake step counts for a target: what its ops save there, what they hold, where the model branched.

On meta, some ops take another path than the target device would; each test compares what the
prediction counts with what the target runs (a real CPU run, or the op the target calls).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

import offload
from offload import MachineProfile, Scope, predict

CPU = offload.Machine.from_probe(
    MachineProfile(device_type="cpu", device_name="test", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0),
    flops=50e9,
    memory_gb_per_s=10.0,
    memory_bytes=8 * 10**9,
    op_overhead_us=5.0,
)


class _Dropouts(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(0.1)) for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_dropout_on_a_cuda_target_saves_a_one_byte_bool_mask():
    """Issue 40, item 2: on meta (and on a CPU) dropout saves its noise in the activation's dtype;
    CUDA's native_dropout saves a bool mask. A CUDA target counts what the GPU saves."""
    x = torch.empty(4, 32, 64, device="meta")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        torch.ops.aten.native_dropout(x.requires_grad_(), 0.1, True)
    assert saved == [torch.bool], "the reference: what CUDA's kernel saves"
    model = _Dropouts()
    on_cpu = predict(model, x, machine=CPU, regions=model.blocks, min_offload_bytes=0)
    on_gpu = predict(model, x, machine="h100-sxm", regions=model.blocks, min_offload_bytes=0)
    mask_elements = 4 * 32 * 64
    for cpu_block, gpu_block in zip(on_cpu.regions[1:-1], on_gpu.regions[1:-1], strict=True):
        assert cpu_block.saved_bytes - gpu_block.saved_bytes == mask_elements * (4 - 1), cpu_block.name
    assert "1-byte bool mask" in "\n".join(on_gpu.assumptions())


def test_grouped_query_attention_saves_k_and_v_as_the_real_run_does():
    """Issue 40, item 9: with fewer key/value heads than query heads, the flash kernels take k and v
    as they are and save them so; the prediction expanded them to every query head. A real CPU run
    of a small Llama (8 query heads, 2 key/value heads; k and v 128 KiB each, over the engine's
    smallest tensor) is the reference; a CUDA target saves the same."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 128))
    kwargs = {"input_ids": ids, "labels": ids}
    layers = model.model.layers
    eng = offload.engine(budget_mb=0.01, policy="auto", regions=layers, model=model)
    for _ in range(4):
        with eng:
            loss = model(**kwargs).loss
        loss.backward()
    measured = {r.name: r for r in eng.profiled_steps[-1].regions}
    eng.close()
    on_cpu = predict(model, machine=CPU, regions=layers, example_kwargs=kwargs)
    on_gpu = predict(model, machine="h100-sxm", regions=layers, example_kwargs=kwargs)
    for cpu_layer, gpu_layer in zip(on_cpu.regions, on_gpu.regions, strict=True):
        if cpu_layer.scope is not Scope.REGION:
            continue
        assert cpu_layer.saved_bytes > 0
        assert cpu_layer.saved_bytes == measured[cpu_layer.name].saved_bytes, cpu_layer.name
        assert gpu_layer.saved_bytes == cpu_layer.saved_bytes, gpu_layer.name


_BRANCHY = """
import torch


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if (x > -1e9).all():  # line 13: the branch on a tensor's value
            x = x * 2
        return x.sum()
"""


def test_a_data_dependent_branch_is_reported_at_the_models_line(tmp_path):
    """Issue 40, item 10: frames are told apart by their module's directory, not by a word in the
    path: a model under a directory named "offload" (a checkout, a virtual environment inside it)
    was skipped as if it were this package, and the branch reported at an outer frame."""
    where = tmp_path / "offload" / "branchy_model.py"
    where.parent.mkdir()
    where.write_text(_BRANCHY)
    spec = importlib.util.spec_from_file_location("branchy_model", where)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["branchy_model"] = module
    try:
        spec.loader.exec_module(module)
        p = predict(module.Branchy(), torch.randn(4, 8), machine=CPU, min_offload_bytes=0)
    finally:
        del sys.modules["branchy_model"]
    assert p.assumed == (f"{where}:13 (forward)",)
    assert f"{where}:13 (forward)" in str(p)


class _Head(torch.nn.Module):
    """Two blocks and an LM head with a cross-entropy loss over a vocabulary much wider than the model."""

    def __init__(self, width: int = 16, vocab: int = 4096) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x, targets):
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_the_largest_transient_is_the_losss_logits_and_their_gradient():
    """Issue 40, item 6: what the running op holds is in the peak. At the loss, the logits'
    gradient exists twice at once (the loss's gradient of the log-probabilities, and the logits'
    gradient made from it), besides every save; each row's device memory counts it."""
    model = _Head()
    x = torch.randn(2, 64, 16)
    targets = torch.randint(0, 4096, (2, 64))
    p = predict(model, x, targets, machine=CPU, regions=model.blocks)
    logits_bytes = 2 * 64 * 4096 * 4
    assert 2 * logits_bytes <= p.transient_bytes <= 2 * logits_bytes + 4096, p.transient_bytes
    keep = next(q for q in p.points if q.policy == "none")
    assert keep.device_bytes == p.parameter_bytes + p.state_bytes + keep.held_bytes + p.transient_bytes
    assert "largest transient" in str(p) and p.to_dict()["transient_bytes"] == p.transient_bytes


class _WideAndShallow(torch.nn.Module):
    """Two 1024 x 1024 layers (4 MiB of weight gradient each) over a batch of one row: the
    parameters' gradients outweigh every activation by far."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.sum()


def test_the_parameters_gradients_are_not_a_transient():
    """The gradients are counted with the parameters (``parameter_bytes`` and the state), so the
    transient peak leaves them out: here it is a few rows of activations, far under one weight's
    gradient."""
    model = _WideAndShallow()
    p = predict(model, torch.randn(1, 1024), machine=CPU, regions=model.blocks)
    weight_grad_bytes = 1024 * 1024 * 4
    assert 0 < p.transient_bytes < weight_grad_bytes // 16, p.transient_bytes
