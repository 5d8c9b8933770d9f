"""The contract a job's workers and nodes share: its spec (parameters, wire dtype, mode), the shard
placement both sides compute from it, the hyperparameters' wire form, and the job's config file. Both
sides import it; neither reaches into the other's package for it."""
