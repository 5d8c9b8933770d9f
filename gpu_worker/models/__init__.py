"""Models used by the demo, the examples and the benchmarks."""

from gpu_worker.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
