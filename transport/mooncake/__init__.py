"""The Mooncake Transfer Engine backend (mooncake:// and mooncake+rdma://): tensor bytes by one-sided
writes, headers over ZeroMQ, credits both ways."""
