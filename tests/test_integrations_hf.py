"""``offload.integrations.hf.OffloadCallback`` under the real ``transformers.Trainer``.

A tiny ``LlamaForCausalLM`` from a config (random weights, nothing downloaded) is trained a few
steps on the CPU by the Trainer itself, with and without the callback, same seed: the logged
losses and the final weights are bitwise equal (the math is identical), the budget-0 engine moved
every byte it saved and brought it back, its spill directory is empty after train end, and the
model's ``forward`` is the model's own again. Gradient accumulation and the model's own gradient
checkpointing are covered; evaluation and generation during training save nothing through the
engine. Skipped without transformers (``pip install -e '.[hf]'``; ``make test`` installs it).
"""

from __future__ import annotations

import copy
import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import offload  # noqa: E402
from offload.bench.padding import Ragged, pad_to_longest  # noqa: E402
from offload.integrations.hf import OffloadCallback  # noqa: E402
from zoo import files_under, most_profiling_steps, tiny_llama  # noqa: E402

BATCH, SEQ, VOCAB = 2, 16, 64
SAMPLES = 8
"""Four optimizer steps at batch 2 without accumulation; two with accumulation 2."""
SEED = 1234
MIN_OFFLOAD_BYTES = 1024
"""Below the default 64 KiB so this tiny model's activations (2 x 16 x 32 fp32 = 4 KiB) move."""
FIGURES = (
    "offload_moved_mb",
    "offload_reloaded_mb",
    "offload_peak_resident_mb",
    "offload_reload_wait_ms",
    "offload_evict_wait_ms",
)


class Tokens(torch.utils.data.Dataset):
    """Fixed random token rows, labels = inputs (causal LM)."""

    def __init__(self, rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama(longest: int = SEQ) -> torch.nn.Module:
    """A tiny Llama for ``VOCAB`` tokens and sequences up to ``longest``."""
    return tiny_llama(width=32, vocab=VOCAB, longest=longest, use_cache=False)


def arguments(
    tmp_path, *, accumulation: int = 1, checkpointing: bool = False, **extra
) -> "transformers.TrainingArguments":
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    fields = transformers.TrainingArguments.__dataclass_fields__
    checkpointing_field = (
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    )
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        save_strategy="no",
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        logging_steps=1,
        learning_rate=1e-2,
        seed=SEED,
        disable_tqdm=True,
        **{checkpointing_field: checkpointing},
        **extra,
    )


def train(model, args, callbacks=(), eval_dataset=None) -> "transformers.Trainer":
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(SAMPLES),
        eval_dataset=eval_dataset,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_same_weights(reference: torch.nn.Module, model: torch.nn.Module, what: str) -> None:
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), f"{what}: final {name} differs"


@pytest.mark.parametrize(
    "accumulation, checkpointing",
    [(1, False), (2, False), (2, True)],
    ids=["plain", "accumulate2", "accumulate2-checkpointing"],
)
def test_trainer_equal_with_callback(accumulation, checkpointing, tmp_path, spill_dir):
    base = llama()
    reference = train(copy.deepcopy(base), arguments(tmp_path, accumulation=accumulation, checkpointing=checkpointing))

    model = copy.deepcopy(base)
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    trainer = train(model, arguments(tmp_path, accumulation=accumulation, checkpointing=checkpointing), [callback])

    assert len(losses(reference)) == SAMPLES // BATCH // accumulation
    assert losses(trainer) == losses(reference)
    assert_same_weights(reference.model, model, f"accumulation {accumulation}, checkpointing {checkpointing}")

    stats = callback.engine.stats  # readable after train end
    assert stats.saved_tensors > 0 and stats.offloaded_bytes > 0
    assert stats.offloaded_bytes == stats.saved_bytes  # budget 0: everything eligible moved
    # and came back for backward; a storage whose backward users are apart is read back once per
    # user (See Note: [held for the next user] in offload/_memory/store.py)
    assert stats.reloaded_bytes > 0  # came back for backward
    assert stats.peak_resident_bytes == 0
    assert files_under(spill_dir) == []  # closed at train end: no spill file left
    assert "forward" not in model.__dict__  # the model's own forward is back

    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(set(FIGURES) <= entry.keys() for entry in entries)
    assert sum(entry["offload_moved_mb"] for entry in entries) == pytest.approx(stats.offloaded_bytes / 2**20)
    assert all(entry["offload_budget_mb"] == 0 for entry in entries)  # the budget in force, fixed here


def test_logs_show_the_budget_in_force_under_auto(tmp_path, spill_dir):
    """budget_mb="auto": the budget follows free memory (read through memory=, 10 MiB free, no
    reserve), and each log entry carries the one in force: resident + free - reserve."""
    free_bytes = 10 * 2**20
    callback = OffloadCallback(
        budget_mb="auto",
        reserve_mb=0,
        memory=lambda: free_bytes,
        min_offload_bytes=MIN_OFFLOAD_BYTES,
        spill_dir=spill_dir,
    )
    trainer = train(llama(), arguments(tmp_path), [callback])
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(entries) == SAMPLES // BATCH
    assert all(entry["offload_budget_mb"] >= 10 for entry in entries), entries
    # The last entry follows the last step: the budget then is the engine's latest reading.
    assert entries[-1]["offload_budget_mb"] == callback.engine.stats.budget_bytes / 2**20


def test_evaluation_and_generation_left_alone(tmp_path, spill_dir):
    """During training, evaluate() (eval mode, no_grad), generate() (no_grad) and a forward in eval
    mode with grad on save nothing through the engine; the training forwards around them do."""
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    seen = []

    class Probe(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            before = callback.engine.stats.saved_tensors
            ids = Tokens(1).ids
            model.generate(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False)
            model.eval()
            model(input_ids=ids, labels=ids).loss.backward()  # grad on, eval mode: not a training forward
            model.zero_grad(set_to_none=True)
            model.train()
            seen.append(("step", before, callback.engine.stats.saved_tensors))
            self.before_eval = callback.engine.stats.saved_tensors

        def on_evaluate(self, args, state, control, **kwargs):
            seen.append(("evaluate", self.before_eval, callback.engine.stats.saved_tensors))

    model = llama()
    train(model, arguments(tmp_path, eval_strategy="steps", eval_steps=1), [callback, Probe()], eval_dataset=Tokens(4))
    assert [kind for kind, _, _ in seen].count("evaluate") == SAMPLES // BATCH
    assert all(before == after for _, before, after in seen), seen
    assert callback.engine.stats.saved_tensors > 0
    assert files_under(spill_dir) == []


def test_bad_engine_arguments_raise_at_construction():
    with pytest.raises(ValueError, match="budget_mb"):
        OffloadCallback(budget_mb=-1)
    with pytest.raises(ValueError, match="policy"):
        OffloadCallback(policy="fastest")
    with pytest.raises(
        TypeError, match=r"OffloadCallback\(\) got unknown keyword\(s\) 'budgte_mb' \(did you mean 'budget_mb'\?\)"
    ):
        OffloadCallback(budgte_mb=1)
    with pytest.raises(TypeError, match="valid keywords: budget_mb, model, regions, "):
        OffloadCallback(regoins="auto")


def test_regions_through_the_callback(tmp_path, spill_dir):
    """regions= reaches the engine: policy "recompute" re-runs every decoder layer each step, and
    the layers' own forwards are back after train end (and after the check at construction)."""
    base = llama()
    reference = train(copy.deepcopy(base), arguments(tmp_path))

    model = copy.deepcopy(base)
    layers = model.model.layers
    callback = OffloadCallback(
        budget_mb=0,
        regions=layers,
        policy="recompute",
        min_offload_bytes=MIN_OFFLOAD_BYTES,
        spill_dir=spill_dir,
    )
    assert all("forward" not in layer.__dict__ for layer in layers)  # the construction check left them alone
    trainer = train(model, arguments(tmp_path), [callback])

    assert losses(trainer) == losses(reference)
    assert_same_weights(reference.model, model, "regions recompute")
    assert callback.engine.stats.recomputed_regions == len(layers) * len(losses(reference))
    # Named from the model the Trainer hands the callback (no model= given), not "region0", ...
    assert [name for name, _ in callback.engine.regions] == [f"model.layers.{i}" for i in range(len(layers))]
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert files_under(spill_dir) == []


def test_second_train_gets_a_fresh_engine(tmp_path, spill_dir):
    model = llama()
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    trainer = train(model, arguments(tmp_path), [callback])
    first = callback.engine
    trainer.train()
    assert callback.engine is not first
    assert callback.engine.stats.saved_tensors == first.stats.saved_tensors > 0  # same steps, same saves
    assert "forward" not in model.__dict__
    assert files_under(spill_dir) == []


def test_accelerate_autocast_forward_kept(tmp_path, spill_dir):
    """With bf16 mixed precision accelerate replaces model.forward by an autocast wrapper before
    train begin: the callback wraps that one (so the forward still runs under autocast), and puts
    it back at train end."""
    base = llama()
    reference = train(copy.deepcopy(base), arguments(tmp_path, bf16=True))

    model = copy.deepcopy(base)
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    forwards = {}

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            forwards["before"] = model.__dict__.get("forward")  # runs before the callback's

        def on_step_end(self, args, state, control, model=None, **kwargs):
            forwards["during"] = model.__dict__.get("forward")

    trainer = train(model, arguments(tmp_path, bf16=True), [Probe(), callback])
    assert losses(trainer) == losses(reference)
    assert_same_weights(reference.model, model, "bf16 autocast")
    assert callback.engine.stats.offloaded_bytes > 0
    assert forwards["before"] is not None  # accelerate's autocast wrapper
    assert forwards["during"] is not forwards["before"] and forwards["during"].__wrapped__ is forwards["before"]
    assert model.__dict__["forward"] is forwards["before"]


def test_forward_wrapped_again_after_train_begin(tmp_path):
    """Another callback wraps model.forward over ours: train end leaves that chain in place, and our
    wrapper in it passes through from then on (it never enters the closed engine)."""
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES)

    class Rewrap(transformers.TrainerCallback):
        def on_epoch_begin(self, args, state, control, model=None, **kwargs):
            inner = model.forward
            model.forward = lambda *a, **k: inner(*a, **k)

    model = llama()
    train(model, arguments(tmp_path), [callback, Rewrap()])
    saved = callback.engine.stats.saved_tensors
    assert saved > 0 and "forward" in model.__dict__  # the other callback's wrapper is still there
    ids = Tokens(1).ids
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # a training-mode forward after train end
    assert callback.engine.stats.saved_tensors == saved


def test_dynamic_padding_with_regions_auto(tmp_path, spill_dir):
    """The loop fine-tuning runs: a new sequence length almost every step, blocks found by
    regions="auto". A handful of profiling steps, then every step under a plan (most of them
    derived from the fit for lengths never measured), and the Trainer's losses and final weights
    bitwise equal to the run without the callback."""
    base = llama(longest=64)  # room for the ragged rows' lengths
    data = Ragged(rows=24, shortest=8, longest=64, vocab=VOCAB)
    args = arguments(tmp_path)

    padded: list[int] = []

    def collate(features):
        batch = pad_to_longest(features)
        padded.append(batch["input_ids"].shape[1])
        return batch

    def run(callbacks):
        model = copy.deepcopy(base)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks
        )
        trainer.train()
        return trainer, model

    reference, reference_model = run([])
    callback = OffloadCallback(budget_mb=0.01, regions="auto", min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    trainer, model = run([callback])
    assert losses(trainer) == losses(reference)
    assert_same_weights(reference_model, model, "dynamic padding, regions='auto'")
    eng = callback.engine
    assert [name for name, _ in eng.regions] == [f"model.layers.{i}" for i in range(2)]
    stages = list(eng.recent_stages)
    assert len(stages) == len(losses(reference)) == len(data) // BATCH
    # a handful: the trials at the first length (their round again where the noise decided and the
    # next batch had the same length, an implausible link reading measured again), and one
    # "recompute" trial per further length measured (``most_profiling_steps``)
    assert sum(s is not None for s in stages) <= most_profiling_steps(
        "auto", shapes=offload.limits.max_measured_shapes
    ), stages
    assert len(set(padded)) >= 8, f"the premise: many distinct padded lengths, got {sorted(set(padded))}"
    derived = [p for p in eng.plans.values() if p.origin.startswith("derived")]
    assert derived, "lengths never measured are planned from the fit"
    assert "_no_split_modules" in offload.explain(eng)
    assert files_under(spill_dir) == []


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_trainer_checkpointing_beside_regions_warns(checkpointing, tmp_path, spill_dir):
    """The Trainer turns the model's own checkpointing on before the callback's engine is made:
    with regions= the engine's first step warns that the regions see only their inputs, once, and
    only where the model checkpoints."""
    model = llama()
    callback = OffloadCallback(
        budget_mb=0, regions="auto", policy="recompute", min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, arguments(tmp_path, checkpointing=checkpointing), [callback])
    named = [str(w.message) for w in caught if "runs its own activation checkpointing" in str(w.message)]
    assert len(named) == (1 if checkpointing else 0), named
