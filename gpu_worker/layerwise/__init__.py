"""Layer-wise mode: the model split into units, each fetched from the nodes just before it computes
and freed after, gradients pushed as their copies leave the device, and same-host CPU workers that
compute straight from a node's parameter board."""
