"""A job's TOML config file (``[node]`` and ``[worker]`` tables), read by the ``netoptim`` commands
and the training recipes."""
