"""The contract a job's workers and nodes share: its spec (parameters, wire dtype, mode), the shard
placement both sides compute from it, and the hyperparameters' wire form. Both runtimes import it;
neither reaches into the other's package for it."""
