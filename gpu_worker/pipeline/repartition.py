"""Moving a pipeline's training state to another stage split (:meth:`PipelineTrainer.repartition`).

Each pipeline position's state lives on its own node group, as its own job. A new split changes which
parameters each position (and so each node group) holds, so the state is gathered by parameter name
(the values and the optimizer's moments and step counts, from the nodes), shared with every rank, and
loaded into the new jobs: the parameters as their initial values, the moments with
``load_state_dict``. Nothing of the math changes, so training continues bit for bit.

Every rank receives every parameter's state (``all_gather_object``): fine for the models a pipeline
trains on CPU hosts here, a cost proportional to the model for large ones (a morph is rare).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpu_worker.pipeline.blocks import pipeline_blocks


@dataclass
class TrainingState:
    """Every parameter's value and optimizer state, by its name in the whole model."""

    values: dict[str, torch.Tensor]
    moments: dict[str, dict[str, Any]]  # name -> torch AdamW's per-parameter state (step, exp_avg, exp_avg_sq)

    def optimizer_state_for(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
        """A torch-format state dict for ``optimizer`` (made over ``named``): its own param groups,
        each parameter's state under the index torch gives it."""
        name_of = {id(param): name for name, param in named}
        state = torch.optim.Optimizer.state_dict(optimizer)  # the groups' layout, without asking the nodes
        params = [param for group in optimizer.param_groups for param in group["params"]]
        state["state"] = {index: self.moments[name_of[id(param)]] for index, param in enumerate(params) if name_of[id(param)] in self.moments}
        return state


def gather_training_state(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], replica: int) -> TrainingState:
    """Replica 0 of each position reads its parameters (``named``) and their state from its nodes
    (``optimizer``); every rank gets all of them."""
    local: dict[str, Any] = {"values": {}, "moments": {}}
    if replica == 0:
        state = optimizer.state_dict()  # from the nodes
        name_of = {id(param): name for name, param in named}
        params = [param for group in optimizer.param_groups for param in group["params"]]
        for index, param in enumerate(params):
            name = name_of[id(param)]
            local["values"][name] = param.detach().to("cpu", copy=True)
            if index in state["state"]:
                local["moments"][name] = {
                    key: value.to("cpu", copy=True) if isinstance(value, torch.Tensor) else value for key, value in state["state"][index].items()
                }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    values = {name: value for part in everyone for name, value in part["values"].items()}
    moments = {name: value for part in everyone for name, value in part["moments"].items()}
    return TrainingState(values, moments)


def load_training_state(model: nn.Module, state: TrainingState) -> None:
    """Put the trained values into ``model`` (built afresh with the same architecture), block by block."""
    named = dict(pair for block in pipeline_blocks(model) for pair in block.named_parameters())
    if named.keys() != state.values.keys():
        missing, extra = sorted(named.keys() - state.values.keys()), sorted(state.values.keys() - named.keys())
        raise ValueError(f"the model given to repartition is not the one trained: parameters missing from the state {missing[:5]}, unknown {extra[:5]}")
    with torch.no_grad():
        for name, param in named.items():
            value = state.values[name]
            if param.shape != value.shape:
                raise ValueError(f"parameter {name} has shape {tuple(param.shape)} in the model given to repartition, {tuple(value.shape)} in training")
            param.copy_(value)
