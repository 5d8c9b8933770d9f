"""The compiled update loop (numba): its kernels, when they are compiled (ahead of use, in a child
process, once), and the self-check against torch's fused AdamW that decides whether a node uses it."""
