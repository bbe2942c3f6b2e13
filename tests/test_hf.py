"""Hugging Face transformers models under the engine: losses and gradients bitwise equal to none.

Real model classes (``LlamaForCausalLM``, ``GPT2LMHeadModel``) from tiny configs with random
weights: nothing is downloaded (``HF_HUB_OFFLINE=1``). Each is trained a few steps with the
engine at budgets None / 0 / small, with and without the model's own gradient checkpointing
(non-reentrant ``torch.utils.checkpoint``: the engine then sees only each layer's inputs), and
with the engine's regions over ``model.model.layers``. The reference is the same model, same
flags, same seeds, without the engine; the math is identical, so ``torch.equal``. GPT-2 keeps
its dropout (0.1), so RNG replay through checkpointing and recompute is covered too.

Skipped when transformers is not installed (``pip install -e '.[hf]'``; ``make test`` installs it).
"""

from __future__ import annotations

import copy
import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest  # noqa: E402
import torch  # noqa: E402

import offload  # noqa: E402
from test_regions import MACHINE, RERUNS, SLOW_DISK  # noqa: E402
from zoo import MB, most_profiling_steps, tiny_llama, wait_clean  # noqa: E402

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 32, 128
STEPS = 2
LR = 1e-2
SEED = 1234
"""Seed set before each step's batch and forward: every run sees the same data and dropout masks."""
MIN_OFFLOAD_BYTES = 1024
"""Below the default 64 KiB so this tiny model's activations (4 x 32 x 64 fp32 = 32 KiB) move."""
SMALL_FRACTION = 0.2
"""The small budget, as a fraction of the bytes one step saves at budget None."""


def llama() -> torch.nn.Module:
    return tiny_llama(width=64, vocab=VOCAB, longest=64)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": llama, "gpt2": gpt2}


def enable_checkpointing(model: torch.nn.Module) -> None:
    """The model's own non-reentrant checkpointing (the method was renamed in transformers 5)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train(model: torch.nn.Module, eng=None, steps: int = STEPS) -> list[tuple[torch.Tensor, dict]]:
    """``steps`` SGD steps; per step the loss and every parameter's gradient."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(steps):
        torch.manual_seed(SEED + step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        if eng is not None:
            with eng:
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history


def assert_same(reference, history, what: str) -> None:
    for step, ((loss_ref, grads_ref), (loss, grads)) in enumerate(zip(reference, history, strict=True)):
        assert torch.equal(loss_ref, loss), f"{what} step {step}: loss {loss.item()} != {loss_ref.item()}"
        assert grads_ref.keys() == grads.keys()
        for name, g in grads_ref.items():
            assert torch.equal(g, grads[name]), f"{what} step {step}: grad of {name} differs"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-checkpointing"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_equal_no_engine(name, checkpointing, spill_dir):
    base = MODELS[name]()
    if checkpointing:
        enable_checkpointing(base)
    reference = train(copy.deepcopy(base))

    eng = offload.engine(None, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    assert_same(reference, train(copy.deepcopy(base), eng), f"{name} budget None")
    counted = wait_clean(eng, spill_dir)
    eng.close()
    assert counted.saved_tensors > 0 and counted.passthrough_tensors > 0
    # Budget None counts its first step only; the later ones run with no hooks (See Note: [no hooks
    # where nothing moves] in offload/_memory/session.py). The steps here are alike (same shapes),
    # and the budgets below count every one of theirs.
    assert counted.uncounted_steps == STEPS - 1
    saved_tensors = counted.saved_tensors * STEPS

    small_mb = SMALL_FRACTION * counted.saved_bytes / MB
    for budget in (0, small_mb):
        eng = offload.engine(budget, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
        assert_same(reference, train(copy.deepcopy(base), eng), f"{name} budget {budget:g}")
        stats = wait_clean(eng, spill_dir)
        eng.close()
        assert stats.saved_tensors == saved_tensors
        assert stats.peak_resident_bytes <= budget * MB
        assert stats.offloaded_bytes >= (1 - SMALL_FRACTION) * stats.saved_bytes


@pytest.mark.parametrize(
    "policy, machine",
    [("recompute", None), ("auto", MACHINE), ("auto", SLOW_DISK)],
    ids=["recompute", "auto", "auto-slow-disk"],
)
def test_llama_layers_as_regions(policy, machine, spill_dir):
    base = llama()
    # Profiling ("auto": measure, recompute, offload, the offload once more when its calibration
    # was implausible, as SLOW_DISK's 0.5 MB/s is beside this disk, and the round again where the
    # noise decides the plan: ``most_profiling_steps``), then the plan.
    steps = most_profiling_steps("auto") + 1
    reference = train(copy.deepcopy(base), steps=steps)

    model = copy.deepcopy(base)
    eng = offload.engine(None, min_offload_bytes=MIN_OFFLOAD_BYTES)
    train(copy.deepcopy(base), eng)
    small_mb = SMALL_FRACTION * eng.stats.saved_bytes / STEPS / MB
    eng.close()

    eng = offload.engine(
        small_mb,
        regions=model.model.layers,
        model=model,
        policy=policy,
        machine=machine,
        min_offload_bytes=MIN_OFFLOAD_BYTES,
        spill_dir=spill_dir,
    )
    assert_same(
        reference, train(model, eng, steps=steps), f"llama regions policy {policy} on {machine and machine.device_name}"
    )
    stats = wait_clean(eng, spill_dir)
    layers = len(model.model.layers)
    if policy == "recompute":
        assert stats.recomputed_regions == layers * steps
    else:
        recompute = sum(d in RERUNS for d in eng.plan.decisions)
        stages = list(eng.recent_stages)
        assert stages[-1] is None, f"still profiling after {steps} steps: {stages}"
        per_stage = {"measure": 0, "offload": 0, "recompute": layers, None: recompute}
        assert stats.recomputed_regions == sum(per_stage[stage] for stage in stages)
        if machine is SLOW_DISK:
            assert recompute > 0, f"auto kept or moved every layer on a 0.5 MB/s disk:\n{eng.plan}"
    eng.close()
    assert model.model.layers[0].__dict__.get("forward") is None  # close() restored the layers


def test_decorated_model(spill_dir):
    """``model = offload.engine(...)(model)``: the form that fits a loop one does not own (Trainer)."""
    base = gpt2()
    reference = train(copy.deepcopy(base))
    eng = offload.engine(0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    model = eng(copy.deepcopy(base))
    assert_same(reference, train(model), "gpt2 decorated")
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_tensors > 0 and stats.offloaded_bytes == stats.saved_bytes
    eng.close()


def test_own_checkpointing_beside_regions_is_named(spill_dir):
    """A model running its own activation checkpointing hides its layers' saves from the regions
    (each sees only its inputs): the first step with regions warns once, naming the model's flag
    and both ways out, and ``explain`` says it too; without the flag neither does. Training stays
    bitwise equal to the same model, same flag, without the engine."""
    for checkpointing in (False, True):
        base = llama()
        if checkpointing:
            enable_checkpointing(base)
        reference = train(copy.deepcopy(base))
        model = copy.deepcopy(base)
        eng = offload.engine(
            None,
            model=model,
            regions="auto",
            policy="recompute",
            min_offload_bytes=MIN_OFFLOAD_BYTES,
            spill_dir=spill_dir,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_same(reference, train(model, eng), f"llama checkpointing={checkpointing}")
        named = [str(w.message) for w in caught if "activation checkpointing" in str(w.message)]
        text = offload.explain(eng)
        eng.close()
        if not checkpointing:
            assert named == [] and "activation checkpointing" not in text, (named, text)
            continue
        assert len(named) == 1, named  # once, though it trained two steps
        for said in ("LlamaForCausalLM", "is_activation_checkpointing", "gradient_checkpointing_disable()", "drop"):
            assert said in named[0], named[0]
        assert named[0].removeprefix("offload: ") in text, text
