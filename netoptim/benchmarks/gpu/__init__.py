"""``netoptim bench gpu``: a GPT trained on one GPU in each mode (netoptim full-model and layer-wise,
DeepSpeed ZeRO-2/3 with CPU offload, torch alone), against the box's own limits measured in the same run."""
