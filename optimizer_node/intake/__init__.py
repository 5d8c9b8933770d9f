"""What comes into a node: a job's admission and registration (HELLO, INIT, the HELLOs that wait for
rank 0), gradients checked completely before they touch state, non-finite gradients, exactly-once
steps across worker restarts (the step ledger) and the job's changes of width (morphing)."""
