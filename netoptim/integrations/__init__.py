"""netoptim in existing training frameworks: the optimizer on the nodes with one change to a script.

- :mod:`netoptim.integrations.huggingface`: ``NetoptimTrainer``, a ``transformers.Trainer`` whose optimizer is
  :class:`~gpu_worker.RemoteAdamW` and whose model is not wrapped in ``DistributedDataParallel``.
- :mod:`netoptim.integrations.hf_accelerate`: ``NetoptimAccelerator``, an ``accelerate.Accelerator`` that
  prepares the model without ``DistributedDataParallel`` (for a script with its own loop).
- :mod:`netoptim.integrations.lightning`: ``NetoptimStrategy``, a Lightning strategy that keeps the process
  group, does not wrap the model, and moves the optimizer the ``LightningModule`` configures to the nodes.
- :mod:`netoptim.integrations.remote`: what they share, a torch optimizer as its remote counterpart (no framework).
- :mod:`netoptim.integrations.hf_layerwise`: a Hugging Face causal LM from its directory, layer-wise, its
  weights read from the shards a tensor at a time (``offload_causal_lm``).
- :mod:`netoptim.integrations.hf_export`: the nodes' checkpoints as a directory ``from_pretrained`` loads
  (``netoptim export --hf``; ``transformers`` only to check the names, where it is installed).
- :mod:`netoptim.integrations.torchao_state`: a remote AdamW's ``state_dict()`` in the layout of torchao's
  8-bit AdamW (``to_torchao_8bit``), so a run moves on to ``torchao.optim.AdamW8bit``.

Each module imports its framework when it is imported, and fails with the ``pip install`` command
that brings it (the ``integrations`` extra) when the framework is missing. This package imports none.
See docs/integrations.md.
"""
