"""A tiny Hugging Face Llama trained for a few steps with and without the engine.

    pip install -e '.[hf]'
    python examples/hf_llama.py [--steps 4] [--budget-mb 1] [--policy auto|recompute|offload]

The model is ``transformers.LlamaForCausalLM`` from a small config with random weights (nothing
is downloaded). With ``--policy auto`` or ``recompute`` the engine's regions are the decoder
layers (``model.model.layers``): on its first steps (up to three) it measures each one, then keeps, offloads or
recomputes it (``auto``; the plan is printed), or recomputes every layer (``recompute``). With
``offload`` there are no regions: the oldest saves move to the spill directory once the budget
is full. Both runs start from the same seed and see the same batches, so the losses must match.

``use_cache`` is off, as for any training run: with it on, a recomputed layer would append its
keys to the returned KV cache a second time (Hugging Face turns it off under its own gradient
checkpointing for the same reason).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config and random weights: never reach the Hub

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import offload  # noqa: E402

SEED = 1234
MB = 1 << 20
LEARNING_RATE = 3e-3
CONFIG = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    use_cache=False,
)


def train(*, steps: int, batch: int, seq: int, engine=None) -> list[dict]:
    """``steps`` AdamW steps from ``SEED``; per step: ms, loss and (with an engine) its stats."""
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.train()
    if engine is not None:
        engine = engine(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    data = torch.Generator().manual_seed(SEED)
    rows = []
    for _ in range(steps):
        ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=data)
        if engine is not None:
            engine.reset_stats()
        start = time.perf_counter()
        with engine if engine is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rows.append(
            {
                "ms": (time.perf_counter() - start) * 1e3,
                "loss": loss.item(),
                "stats": engine.stats if engine is not None else None,
            }
        )
    if engine is not None:
        if engine.plan is not None:
            print(engine.plan)
        engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget-mb", type=float, default=1.0, help="activation MB the engine may keep on the device")
    parser.add_argument("--policy", choices=("auto", "recompute", "offload"), default="auto")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    def make_engine(model):
        if args.policy == "offload":
            return offload.engine(args.budget_mb, model=model)
        return offload.engine(args.budget_mb, model=model, regions=model.model.layers, policy=args.policy)

    print(
        f"LlamaForCausalLM {CONFIG['num_hidden_layers']}x{CONFIG['hidden_size']}, batch "
        f"{args.batch_size}x{args.seq_len}, on cpu; engine budget {args.budget_mb:g} MB, policy {args.policy}"
    )
    run = dict(steps=args.steps, batch=args.batch_size, seq=args.seq_len)
    baseline = train(**run)
    managed = train(**run, engine=make_engine)

    header = (
        f"{'step':>4} | {'ms plain':>9} {'ms engine':>9} | {'loss plain':>10} {'loss engine':>11} | "
        f"{'saved MB':>8} {'moved MB':>8} {'peak MB':>7} {'recomp':>6}"
    )
    print(header)
    print("-" * len(header))
    for step, (plain, ours) in enumerate(zip(baseline, managed, strict=True)):
        s = ours["stats"]
        print(
            f"{step:>4} | {plain['ms']:>9.1f} {ours['ms']:>9.1f} | {plain['loss']:>10.6f} {ours['loss']:>11.6f} | "
            f"{s.saved_bytes / MB:>8.2f} {s.offloaded_bytes / MB:>8.2f} {s.peak_resident_bytes / MB:>7.2f} "
            f"{s.recomputed_regions:>6}"
        )
    match = all(plain["loss"] == ours["loss"] for plain, ours in zip(baseline, managed, strict=True))
    print(f"losses match exactly: {'yes' if match else 'NO'}")


if __name__ == "__main__":
    main()
