"""Built-in models and data for the demo, the benchmarks and the tests.

``MiniGPT`` is a small byte-level transformer; ``load_corpus`` and ``batches`` feed it
the Python standard library's own source, so nothing needs downloading.
"""

from offload.models.corpus import batches, load_corpus
from offload.models.gpt import Block, GPTConfig, MiniGPT

__all__ = ["Block", "GPTConfig", "MiniGPT", "batches", "load_corpus"]
