"""Train a GPT with pipeline parallelism (P stages x D replicas) and its optimizer on netoptim nodes.

Rank ``r`` computes pipeline position ``r % P`` of replica ``r // P``. Each pipeline position is its
own netoptim job on its own node group: ``--nodes`` is dealt out in ``P`` equal groups, in order.

One host, 2 stages x 1 replica, one node per stage::

    netoptim node --listen tcp://127.0.0.1:5555 &
    netoptim node --listen tcp://127.0.0.1:5556 &
    torchrun --standalone --nproc-per-node 2 examples/train_gpt_pipeline.py \\
        --nodes tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 --stages 2 --microbatches 4 --schedule 1f1b

2 stages x 2 replicas (four ranks), interleaved schedule, cut points chosen by ``netoptim plan``::

    netoptim plan --n-layer 8 --workers 4 --nodes 2 --global-batch 16
    torchrun --standalone --nproc-per-node 4 examples/train_gpt_pipeline.py --nodes tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 \\
        --stages 2 --microbatches 4 --schedule interleaved --cuts 3,5,7 --n-layer 8 --global-batch 16

Several hosts: start the nodes on the CPU hosts (``--listen tcp://0.0.0.0:5555`` with
``--curve-secret-key``/``--curve-allow``, see docs/operations.md; the workers take ``--curve-secret-key
'keys/worker{rank}.key_secret' --curve-server-key keys/node.key``) and run torchrun on each worker host with ``--nnodes``, ``--node-rank``, ``--master-addr`` as for any torchrun job; every
rank lists the nodes in the same order. ``--cuts auto`` (the default) balances the stages on a short
calibration that rank 0 runs and broadcasts.
"""

from netoptim.recipes.train_gpt_pipeline import main

if __name__ == "__main__":
    raise SystemExit(main())
