"""The ZeroMQ backend (tcp:// and ipc://): a ROUTER on the node, one DEALER per worker-to-node
connection, CURVE security, and the link monitor."""
