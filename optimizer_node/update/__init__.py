"""The update: summing the workers' gradients, global-norm clipping, the update rules (AdamW, Adam,
SGD, Lion) and the one-pass update of a bucket, which path runs it (compiled loop or torch ops), and
the queue of ready updates with the thread that may run them."""
