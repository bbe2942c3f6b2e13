"""The tiny Hugging Face Llama that ``bench/predict.py``, ``bench/shapes.py`` and
``bench/shape_cases.py`` measure, and the ``Trainer`` arguments the bench's CPU runs share.

``transformers.LlamaForCausalLM`` from a config (4 layers, width 256, 4 heads) with random weights
from seed 0: nothing is downloaded (the scripts set ``HF_HUB_OFFLINE=1`` before importing it).
transformers is imported on the first call, so a script that never builds the model runs without it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def tiny_llama(*, vocab: int = 512, longest: int = 512, attn_implementation: Optional[str] = None) -> torch.nn.Module:
    """The model for ``vocab`` tokens and sequences up to ``longest``; ``attn_implementation=None``
    is transformers' own choice."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=longest,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return transformers.LlamaForCausalLM(config)


def cpu_trainer_args(out: str, batch: int, *, learning_rate: float, logging_steps: int) -> Any:
    """``transformers.TrainingArguments`` for the bench's CPU runs: one epoch, ``batch`` rows a
    step, seed 1234, no reporters, no checkpoints, no progress bar, the data loaded in the
    training process; ``out`` the (temporary) output directory. Returns the arguments (typed Any:
    transformers is imported here, on the first call)."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        save_strategy="no",
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        logging_steps=logging_steps,
        learning_rate=learning_rate,
        seed=1234,
        disable_tqdm=True,
    )
