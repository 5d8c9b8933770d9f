"""``netoptim doctor``: checks of a host (software, CPUs, memory, disk) and of the nodes a worker here
would use, each finding with what to do about it."""
