"""Ten Hugging Face architectures under every policy, gradients bitwise equal to no engine.

Tiny random configs (nothing downloaded) of the model families people fine-tune: decoder-only
(Llama, Mistral, Qwen2, Gemma, Phi, Mixtral's mixture of experts, GPT-2, GPT-NeoX), an encoder
(BERT) and an encoder-decoder (T5, whose decoder blocks take a cache object they fill). Each is
trained two SGD steps in training mode (dropout where the config has it) with its blocks found
by ``regions="auto"`` and planned "offload" at budget 0, "recompute", "selective" and "auto" at a
small budget; the losses and every gradient must equal those of the same model without the engine.

One exception, and its oracle: T5 under the policies that re-run blocks. Its encoder's output
feeds every decoder block, so recomputing those blocks changes the order in which autograd adds
up that output's gradient, by a few ulps (5e-8 here), exactly as the model's own gradient
checkpointing (``torch.utils.checkpoint``) does. Under "recompute" the reference is the model
with its own non-reentrant checkpointing, bitwise; "selective" and "auto" build yet another
graph (replayed or mixed blocks), so there both references are matched to 1e-6.
"""

from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest  # noqa: E402
import torch  # noqa: E402

import offload  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS, LR = 96, 2, 16, 2, 1e-2
MACHINE = offload.MachineProfile(
    device_type="cpu", device_name="test machine", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0
)
"""Fixed costs: no probe, the same plans on any machine."""
MIN_OFFLOAD_BYTES = 256
"""These tiny models save KiB-sized tensors; below the default 64 KiB so they are managed."""

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB)


def _decoder(config_name: str, model_name: str, **extra):
    def make():
        config = getattr(transformers, config_name)(**{**SMALL, "max_position_embeddings": 64, **extra})
        return getattr(transformers, model_name)(config)

    return make


def _gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(**SMALL, max_position_embeddings=64)
    return transformers.BertForMaskedLM(config)


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


ARCHITECTURES = {
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2),
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8),
    "phi": _decoder("PhiConfig", "PhiForCausalLM"),
    "mixtral": _decoder("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4),
    "gpt2": _gpt2,
    "gpt_neox": _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "bert": _bert,
    "t5": _t5,
}
POLICIES = {"offload": 0, "recompute": 0.01, "selective": 0.01, "auto": 0.01}
"""Policy -> budget_mb: "offload" moves everything; the others re-run every block or weigh it."""


def batch(name: str, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def train(name: str, model: torch.nn.Module, eng=None) -> list:
    model.train()
    history = []
    for step in range(STEPS):
        inputs = batch(name, step)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234 + step)
        if eng is None:
            loss = model(**inputs).loss
        else:
            with eng:
                loss = model(**inputs).loss
        loss.backward()
        history.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return history


RERUNS = ("recompute", "selective", "auto")
ACCUMULATION_ORDER_TOLERANCE = 1e-6
"""T5 re-run against no checkpointing at all: float sums in another order (see the module docstring)."""


def own_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


@pytest.fixture(scope="module")
def references():
    return {}


def reference(name: str, base: torch.nn.Module, policy: str, references: dict) -> list:
    key = (name, name == "t5" and policy in RERUNS)
    if key not in references:
        model = copy.deepcopy(base)
        references[key] = train(name, own_checkpointing(model) if key[1] else model)
    return references[key]


@pytest.mark.sweep
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_under_policy_is_exact(name, policy, references, spill_dir):
    torch.manual_seed(0)
    base = ARCHITECTURES[name]()
    want = reference(name, base, policy, references)
    exact = not (name == "t5" and policy in ("selective", "auto"))
    model = copy.deepcopy(base)
    eng = offload.engine(
        POLICIES[policy],
        regions="auto",
        model=model,
        policy=policy,
        machine=MACHINE,
        spill_dir=spill_dir,
        min_offload_bytes=MIN_OFFLOAD_BYTES,
    )
    history = train(name, model, eng)
    for step, ((loss_ref, grads_ref), (loss, grads)) in enumerate(zip(want, history, strict=True)):
        assert torch.equal(loss_ref, loss), f"{name} under {policy}, step {step}: loss differs"
        assert grads_ref.keys() == grads.keys()
        for param, g in grads_ref.items():
            if exact:
                assert torch.equal(g, grads[param]), f"{name} under {policy}, step {step}: grad of {param} differs"
            else:
                torch.testing.assert_close(grads[param], g, atol=ACCUMULATION_ORDER_TOLERANCE, rtol=0)
    assert eng.stats.saved_tensors > 0
    eng.close()
    if name == "t5" and policy in RERUNS:
        plain = reference(name, base, "offload", references)
        for (_, grads_plain), (_, grads) in zip(plain, history, strict=True):
            for param, g in grads_plain.items():
                torch.testing.assert_close(grads[param], g, atol=ACCUMULATION_ORDER_TOLERANCE, rtol=0)
