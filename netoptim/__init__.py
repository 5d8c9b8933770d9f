"""netoptim: train models larger than their GPUs, with the optimizer on CPU nodes in the network.

The runtime lives in four packages of its own: :mod:`gpu_worker` (the training side, with
``RemoteAdamW`` and ``offload``), :mod:`optimizer_node` (the daemon), :mod:`transport` (the data
plane) and :mod:`protos` (the admin service's messages). This package holds what sits around them:

- :mod:`netoptim.job`: the job's TOML config file (the contract both runtimes share is :mod:`protos.job`, below them);
- :mod:`netoptim.console` and :mod:`netoptim.cli`: the ``netoptim`` command;
- :mod:`netoptim.doctor`: ``netoptim doctor``, a host's and a node's checks before a run;
- :mod:`netoptim.benchmarks`: ``netoptim bench``, each against a baseline in the same run;
- :mod:`netoptim.planning`: step-time, memory and cost models behind ``netoptim plan``;
- :mod:`netoptim.cluster`: an emulated cluster of hosts on one machine;
- :mod:`netoptim.launch`: local processes of a job (nodes and workers on this machine);
- :mod:`netoptim.integrations`: Hugging Face ``Trainer``, accelerate and Lightning;
- :mod:`netoptim.recipes`: ready training scripts (the GPT recipes behind ``netoptim demo``).

Importing this package imports nothing else. The runtimes import nothing from it: the layers run one
way (``.importlinter``).
"""

__version__ = "0.2.0"
DISTRIBUTION = "netoptim-train"  # the name on the package index: pip install netoptim-train
