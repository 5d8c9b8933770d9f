"""The full-model exchange of a step: gradients pushed as backward completes each bucket (paced by a
push window, from a thread of their own on a GPU), and the new values awaited and installed into the
model's parameters (the next forward waits for its own buckets only)."""
