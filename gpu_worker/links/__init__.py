"""A worker's links to its job's optimizer nodes: the connections, registration, the receive loop and
what each node message means, liveness and diagnosis of a silent node, a node's recovery, and
where a restarted worker resumes."""
