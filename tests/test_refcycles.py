"""Nothing the engine returns to autograd may close a reference cycle through the graph.

Autograd's graph lives in C++: Python's cycle collector cannot see a cycle that runs through a
node's saved variables, so such a cycle is never freed, and everything on it (activations,
spill files, a recompute frame's inputs) leaks. Two ways the engine could close one, each found
with a Hugging Face model and reduced here:

- a saved tensor passed through unchanged: a node that saves its own output (tanh, sigmoid,
  softmax, attention) then holds that output, whose ``grad_fn`` is the node. With backward, the
  saved variable is released and the cycle opens; a forward without backward leaked the graph.
- a recomputed region that hands a tensor to an argument it was given (a KV cache): the
  recompute's graph outlives it, and its hooks held the frame, which holds the argument.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import offload
from zoo import wait_clean

WIDTH = 128


def _forward_only(ctx) -> bool:
    """Run a forward whose saves include a node's own output, drop it; True if the graph survived."""
    x = torch.randn(WIDTH, WIDTH, requires_grad=True)
    with ctx:
        out = torch.sigmoid(torch.tanh(x @ x))  # tanh and sigmoid save their outputs
        loss = out.sum()
    alive = weakref.ref(out)
    del out, loss
    gc.collect()
    return alive() is not None


@pytest.mark.parametrize(
    "make_ctx",
    [
        lambda: offload.engine(None, min_offload_bytes=1 << 30),  # everything passes through
        lambda: offload.engine(0, min_offload_mb=0),  # everything is taken
        offload.no_offload,
    ],
    ids=["engine-passthrough", "engine-takes", "no_offload"],
)
def test_forward_without_backward_frees_the_graph(make_ctx):
    ctx = make_ctx()
    assert not _forward_only(ctx), "the forward's graph outlived every reference to it"
    if isinstance(ctx, offload.Engine):
        stats = wait_clean(ctx)
        assert stats.saved_tensors + stats.passthrough_tensors > 0
        ctx.close()


def test_passthrough_keeps_results_and_in_place_check():
    """Passing through a detached alias changes nothing autograd computes or checks."""
    x = torch.randn(WIDTH, WIDTH, requires_grad=True)
    eng = offload.engine(None, min_offload_bytes=1 << 30)
    with eng:
        y = torch.sigmoid(x)
    y.sum().backward()
    want = torch.sigmoid(x) * (1 - torch.sigmoid(x))
    assert torch.equal(x.grad, want.detach())
    with eng:
        y = torch.sigmoid(x)
    y.add_(1)  # sigmoid saved its output; backward must refuse it, as without the engine
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    eng.close()


class _Cache:
    """Stands for a Hugging Face KV cache: an argument the region appends tensors to."""

    def __init__(self) -> None:
        self.items: list = []


def test_recomputed_region_storing_into_an_argument_releases_everything(spill_dir):
    torch.manual_seed(0)
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)

    def region(x, cache):
        y = torch.tanh(x @ w)
        cache.items.append(y)
        return torch.sigmoid(y)

    x = torch.randn(64, WIDTH, requires_grad=True)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    cache = _Cache()
    with eng:
        h = x * 2  # the region's input is an activation: the engine moves it
        loss = offload.checkpoint(region, h, cache).sum()
    del h
    loss.backward()
    assert len(cache.items) == 2  # forward and recompute each appended (as with torch.utils.checkpoint)
    del loss
    stats = wait_clean(eng, spill_dir)  # while the cache, and the recompute's graph in it, lives on
    assert stats.saved_tensors > 0
    eng.close()


def _live_tensor_bytes() -> int:
    gc.collect()
    return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if type(o) is torch.Tensor)


@pytest.mark.parametrize("policy", ["auto", "selective", "recompute", "offload"])
def test_profiling_steps_at_changing_shapes_keep_nothing(policy, spill_dir):
    """Every profiling stage (measure, the recompute trial with its selective re-run, the offload
    trial) and every plan at a new input shape leaves no tensor behind once its step is over: the
    live tensors after many steps at changing shapes are the model's and nothing else."""
    from offload.models import GPTConfig, MiniGPT

    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=3, n_embd=64, n_head=4, seq_len=96))
    eng = offload.engine(0.05, policy=policy, regions=model.blocks, model=model, spill_dir=spill_dir)
    before = _live_tensor_bytes()
    for seq in (32, 48, 64, 80, 96, 32, 48):
        for _ in range(3):
            idx = torch.randint(0, 256, (2, seq))
            with eng:
                loss = model(idx, idx)[1]
            loss.backward()
            model.zero_grad(set_to_none=True)
            del loss
        with eng:  # a forward whose backward never runs, in the middle of the profiling
            model(idx, idx)
    del idx
    assert _live_tensor_bytes() == before, "tensors outlived the steps that made them"
    assert policy == "recompute" or len(eng.profiled_steps) >= 2  # "recompute" measures nothing
    eng.close()
