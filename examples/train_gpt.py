"""Train a small GPT-style model with the optimizer on netoptim nodes, as a plain ``torchrun`` script.

One host, two workers, one optimizer node::

    netoptim node --listen tcp://127.0.0.1:5555 &
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --nodes tcp://127.0.0.1:5555

Several hosts (two worker hosts with 4 workers each, optimizer nodes on two CPU hosts)::

    # once: netoptim keygen --dir keys --name node; and per rank r: --name worker{r} --ranks r;
    # copy the workers' .key files (public) into allowed/
    # on each CPU host (10.0.0.11 and 10.0.0.12)
    netoptim node --listen tcp://0.0.0.0:5555 --curve-secret-key keys/node.key_secret --curve-allow allowed
    # on worker host 0 (10.0.0.1) and worker host 1, with --node-rank 0 and 1
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 \\
        examples/train_gpt.py --nodes tcp://10.0.0.11:5555,tcp://10.0.0.12:5555 --global-batch 64 \\
        --curve-secret-key 'keys/worker{rank}.key_secret' --curve-server-key keys/node.key

Every rank lists the nodes in the same order. Instead of the list, ``--nodes`` takes a host file (one
address per line), and without ``--nodes`` the recipe reads ``$NETOPTIM_NODES`` or the host file
``$NETOPTIM_NODE_FILE``: either is read on rank 0 only, which hands the list to the other ranks through
torchrun's store (docs/launch.md; Slurm and Kubernetes in examples/slurm/ and examples/kubernetes/)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job7 \\
        examples/train_gpt.py --nodes nodes.txt --global-batch 64 \\
        --curve-secret-key 'keys/worker{rank}.key_secret' --curve-server-key keys/node.key

A worker that dies is restarted with the same command (``torchrun --max-restarts 3`` does it): it starts at ``optimizer.remote_step``, the step the
nodes say this rank must (re)do, with the data of that step (a function of the step and the rank
only), and pushes only what the nodes lack: the run ends bitwise where an uninterrupted one would. A
node restarted with ``--resume`` on the same address is reconnected to by the running workers. See
docs/faults.md.
"""

from netoptim.recipes.train_gpt import main

if __name__ == "__main__":
    raise SystemExit(main())
