"""What a job's workers and nodes agree on, below both: the job's contract (:mod:`protos.job`: its
spec, the shard placement both sides compute from it, the hyperparameters' wire form) and the admin
service's gRPC messages (``admin.proto`` and the code generated from it)."""
