"""A copy of a model under an engine is a model of its own: See Note: [a copy carries no engine].

EMA models, DPO reference models and evaluation copies are made with ``copy.deepcopy`` (or saved
and loaded) while the model is under an engine. Each form of copy, of each way an engine reaches
into a model (the decorator, regions given as modules, found by ``"auto"``, chosen by a filter,
and the Hugging Face callback), must compute with the copy's own parameters, train only them,
pickle, and carry no engine, while the original goes on under its engine untouched. The oracle is
the model before any engine, copied the same way.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import offload
from offload.models import Block
from zoo import GPTLoss, assert_same, gpt, run_step

ENGINE_ATTRIBUTES = ("forward", "_compiled_call_impl", "offload_engine", "__getstate__")
"""What the engine may set on a module instance; none of it may reach a copy."""


def _copy_deep(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def _copy_pickle(model: torch.nn.Module) -> torch.nn.Module:
    return pickle.loads(pickle.dumps(model))


def _copy_torch_save(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": _copy_deep, "pickle": _copy_pickle, "torch.save": _copy_torch_save}


def _decorated(model):
    return offload.engine(budget_mb=0, min_offload_mb=0)(model), None


def _decorated_with_regions(model):
    return offload.engine(budget_mb=0, min_offload_mb=0, regions="auto", policy="recompute")(model), None


def _regions_as_modules(model):
    return model, offload.engine(
        budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="offload"
    )


def _regions_auto(model):
    return model, offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions="auto", policy="recompute")


def _regions_by_filter(model):
    eng = offload.engine(
        budget_mb=0,
        min_offload_mb=0,
        model=model,
        regions=lambda module, name: isinstance(module, Block),
        policy="selective",
    )
    return model, eng


FORMS = {
    "decorator": _decorated,
    "decorator+auto": _decorated_with_regions,
    "regions=modules": _regions_as_modules,
    "regions=auto": _regions_auto,
    "regions=filter": _regions_by_filter,
}


def _engine_of(model, eng):
    return eng if eng is not None else model.offload_engine


def _entered(form: str, eng):
    """The engine a step enters itself: a decorated model enters its own in its forward."""
    return None if form.startswith("decorator") else eng


def _net() -> torch.nn.Module:
    """MiniGPT returning its loss (``model.model.blocks`` are the blocks)."""
    return GPTLoss(gpt(dropout=0.1))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 17))


def _step(model, eng=None):
    return run_step(model, _tokens, eng, loss_fn=lambda loss: loss, input_grad=False)


def _assert_plain(twin: torch.nn.Module) -> None:
    for name, module in twin.named_modules():
        held = [a for a in ENGINE_ATTRIBUTES if a in module.__dict__]
        assert not held, f"the copy's module {name or '(root)'} holds the engine's {held}"


@pytest.mark.sweep
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("how", COPIES)
def test_a_copy_computes_and_trains_with_its_own_parameters(form, how, spill_dir):
    base = _net()
    reference = copy.deepcopy(base)
    model, eng = FORMS[form](copy.deepcopy(base))
    eng = _engine_of(model, eng)
    for _ in range(2):  # under the engine first: regions found, wrapped, profiled
        _step(model, _entered(form, eng))

    twin = COPIES[how](model)
    # A step of the copy, outside any engine, equals a step of the model before any engine, done
    # the same number of times: the copy holds the original's weights (two steps of gradients
    # are not applied: no optimizer), and computes with them itself.
    assert_same(_step(reference), _step(twin), f"{form}, {how}: the copy against the model without an engine")
    assert all(p.grad is not None for p in twin.parameters()), "the copy's step left parameters without gradients"

    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    _step(twin)
    assert all(p.grad is None for p in model.parameters()), "training the copy put gradients in the original"
    _assert_plain(twin)
    assert not hasattr(twin, "offload_engine")

    with torch.no_grad():  # the copy computes with its own parameters, not the original's
        for p in twin.parameters():
            p.zero_()
    x = _tokens()
    assert not torch.equal(twin(x), model(x))

    # The original is still under its engine, and still equal to the model without one.
    before = eng.stats.saved_tensors
    assert_same(_step(reference), _step(model, _entered(form, eng)), f"{form}: the original")
    assert eng.stats.saved_tensors > before
    eng.close()


@pytest.mark.parametrize("form", FORMS)
def test_a_shallow_copy_carries_no_engine_either(form, spill_dir):
    model, eng = FORMS[form](_net())
    eng = _engine_of(model, eng)
    _step(model, _entered(form, eng))
    twin = copy.copy(model)
    assert "forward" not in twin.__dict__ and "offload_engine" not in twin.__dict__
    reference = copy.deepcopy(twin)  # the model's own forward, shared parameters
    assert_same(_step(reference), _step(twin), f"{form}: a shallow copy")
    eng.close()


def test_a_copy_under_an_engine_of_its_own(spill_dir):
    """Wrapping the copy gives it an engine of its own; the original's is not touched."""
    base = _net()
    reference = copy.deepcopy(base)
    model = offload.engine(budget_mb=0, min_offload_mb=0)(copy.deepcopy(base))
    twin = offload.engine(budget_mb=0, min_offload_mb=0)(copy.deepcopy(model))
    assert twin.offload_engine is not model.offload_engine
    assert_same(_step(reference), _step(twin), "a copy under its own engine")
    assert twin.offload_engine.stats.saved_tensors > 0
    assert model.offload_engine.stats.saved_tensors == 0
    for m in (model, twin):
        m.offload_engine.close()


def test_close_leaves_the_modules_as_they_were(spill_dir):
    model = _net()
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="recompute")
    _step(model, eng)
    assert all("__getstate__" in block.__dict__ for block in model.model.blocks)
    eng.close()
    for block in model.model.blocks:
        assert "forward" not in block.__dict__ and "__getstate__" not in block.__dict__


def test_a_forward_set_before_the_engine_is_what_the_copy_gets(spill_dir):
    """A module whose instance ``forward`` was already someone's wrapper keeps it in the copy."""
    model = _net()
    block = model.model.blocks[0]
    calls = []

    def counting(x, forward=block.forward):
        calls.append(1)
        return forward(x)

    block.forward = counting
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="offload")
    _step(model, eng)
    assert len(calls) == 1
    twin = copy.deepcopy(model)
    assert twin.model.blocks[0].__dict__.get("forward") is counting
    eng.close()
    assert model.model.blocks[0].__dict__.get("forward") is counting


def test_a_model_copied_during_hf_training_is_its_own(tmp_path, spill_dir):
    """The Trainer callback's model, copied from inside training (an EMA or reference model)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import transformers

    from offload.integrations.hf import OffloadCallback
    from test_integrations_hf import Tokens, arguments, llama

    class Copier(transformers.TrainerCallback):
        def __init__(self):
            self.copies = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.copies.append((copy.deepcopy(model), pickle.loads(pickle.dumps(model))))

    copier = Copier()
    model = llama()
    trainer = transformers.Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=Tokens(4),
        callbacks=[OffloadCallback(budget_mb=0, spill_dir=spill_dir, min_offload_bytes=1024), copier],
    )
    trainer.train()
    assert copier.copies
    ids = torch.randint(0, 64, (2, 16))
    for deep, pickled in copier.copies:
        for twin in (deep, pickled):
            _assert_plain(twin)
            twin.train()
            out = twin(input_ids=ids, labels=ids)
            out.loss.backward()
            assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters()), "training a copy put gradients in the Trainer's model"
    with torch.no_grad():
        twin = copier.copies[-1][0]
        for p in twin.parameters():
            p.zero_()
    model.eval()
    twin.eval()
    assert not torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_wrapper_set_on_top_of_the_engines_is_left_out_with_a_warning(spill_dir):
    """accelerate wraps ``forward`` again after the engine did: that wrapper calls the engine's,
    which calls the original module, so the copy cannot keep it; it says so."""
    base = _net()
    reference = copy.deepcopy(base)
    model = offload.engine(budget_mb=0, min_offload_mb=0)(copy.deepcopy(base))
    inner = model.forward

    def autocast_like(*args, **kwargs):
        return inner(*args, **kwargs) * 1.0

    model.forward = autocast_like
    with pytest.warns(UserWarning, match="wrapped again after the engine wrapped it"):
        twin = copy.deepcopy(model)
    _assert_plain(twin)
    assert_same(_step(reference), _step(twin), "the copy: its own forward")
    assert all(p.grad is None for p in model.parameters())
    model.offload_engine.close()


class _OwnState(torch.nn.Module):
    """A module class whose ``__getstate__`` returns its own ``__dict__`` (not a copy of it), as some
    user classes do: the engine must leave its attributes out of the copy's state, not the original's."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

    def __getstate__(self):
        return self.__dict__


def test_a_class_whose_getstate_returns_its_own_dict(spill_dir):
    base = _net()
    base.model.blocks = torch.nn.ModuleList(_OwnState(b) for b in base.model.blocks)
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="recompute")
    _step(model, eng)
    twin = copy.deepcopy(model)
    _assert_plain(twin)
    assert_same(_step(reference), _step(twin), "the copy")
    # The original keeps the engine: its blocks are still wrapped, and its steps still re-run them.
    assert all("forward" in b.__dict__ and "__getstate__" in b.__dict__ for b in model.model.blocks)
    before = eng.stats.recomputed_regions
    assert_same(_step(reference), _step(model, eng), "the original under its engine")
    assert eng.stats.recomputed_regions > before
    eng.close()


def test_a_model_under_two_engines_in_turn_copies_as_before_either(spill_dir):
    """One engine's regions, then another's over the same blocks (the second wraps the first's
    wrapper): the copy is the model as it was before the first."""
    base = _net()
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    blocks = model.model.blocks
    first = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=blocks, policy="recompute")
    _step(model, first)
    second = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=blocks, policy="offload")
    _step(model, second)
    model.zero_grad(set_to_none=True)
    for how, copy_ in COPIES.items():
        twin = copy_(model)
        _assert_plain(twin)
        assert_same(_step(reference), _step(twin), f"{how}: the copy against the model without an engine")
    assert all(p.grad is None for p in model.parameters()), "training a copy put gradients in the original"
    before = second.stats.saved_tensors
    assert_same(_step(reference), _step(model, second), "the original under the second engine")
    assert second.stats.saved_tensors > before
    second.close()
    first.close()
    assert all("forward" not in b.__dict__ and "__getstate__" not in b.__dict__ for b in model.model.blocks)


def test_two_engines_closed_in_the_order_they_came(spill_dir):
    """The first engine closed while the second still wraps the same blocks: the second keeps its
    regions (its steps still re-run them, exactly), a copy is still the model before either, and
    once both are closed the blocks hold nothing of either engine."""
    base = _net()
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    blocks = model.model.blocks
    first = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=blocks, policy="offload")
    _step(model, first)
    second = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=blocks, policy="recompute")
    _step(model, second)
    first.close()
    before = second.stats.recomputed_regions
    assert_same(_step(reference), _step(model, second), "the second engine after the first closed")
    assert second.stats.recomputed_regions == before + len(blocks), "the second engine lost its regions"
    twin = copy.deepcopy(model)
    _assert_plain(twin)
    assert_same(_step(reference), _step(twin), "a copy between the two closes")
    second.close()
    _assert_plain(model)
    assert_same(_step(reference), _step(model), "the model after both engines")
