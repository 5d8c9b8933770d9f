"""Where a node keeps its buckets' fp32 masters and optimizer state: in memory or out of core under a
memory budget, crash-safe checkpoints and resume, the memory plan checked before anything is
allocated, state transfer for state_dict(), and the export to one state dict."""
