"""Models used by the demo, the examples and the benchmarks."""

from gpu_worker.models.gpt import GPT, GPTConfig, gpt_initializer

__all__ = ["GPT", "GPTConfig", "gpt_initializer"]
