"""Callbacks that put a trainer's training forwards under one offload engine.

    from offload.integrations.hf import OffloadCallback         # transformers.Trainer: pip install 'offload[hf]'
    from offload.integrations.lightning import OffloadCallback  # lightning.Trainer:    pip install 'offload[lightning]'

Each submodule imports its own framework; importing this package imports neither. A loop one owns
(plain PyTorch, or ``accelerate``) needs no callback: put the forward under ``with eng:``.
"""
