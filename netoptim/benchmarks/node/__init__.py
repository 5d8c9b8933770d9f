"""The benchmarks of one node's own work: its update of a bucket (AdamW, the other rules, compressed
moments), its out-of-core store against the disk, and the per-bucket cost of a step."""
