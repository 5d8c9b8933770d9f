"""The node's admin plane: the gRPC service (status, live hyperparameters, checkpoint, drain, shutdown,
health, reflection), its guards and address, and what an operator can do to a running job (pause,
resume, hyperparameter overrides)."""
