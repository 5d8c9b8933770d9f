"""What a node's update threads do between passes: sleep, or spin on their CPUs.

The node's compiled update loop runs on numba's OpenMP threads. An OpenMP thread that finishes its
share of a pass spins, by default, for ~300,000 polls (10-20 ms here) before it sleeps, ready for
the next pass at once. Where the node has CPUs of its own (``--cpus``/``--numa-node``: a GPU host's
node) that costs nothing but those CPUs. Where it shares them with workers (a CPU host, the demo,
the benchmarks on one machine) each spin takes a CPU from a worker's forward and backward, after
every pass: on 2 cores a node spent 0.43 s of CPU a layer-wise step spinning and updating, and
0.14 s sleeping (``bench train --sizes base``, medians of 6 runs each).

OpenMP reads its wait policy (``OMP_WAIT_POLICY``) once, when its runtime loads, and torch loads
it at ``import torch`` (numba's loop and torch's intra-op threads share that one runtime), so
``netoptim node`` calls :func:`apply_update_thread_wait` before it imports torch.
"""

from __future__ import annotations

import os
import sys

WAIT_CHOICES = ("auto", "sleep", "spin")
POLICY_ENV = "OMP_WAIT_POLICY"


def resolve_update_thread_wait(choice: str, *, own_cpus: bool, environ: dict[str, str] | None = None) -> str:
    """``sleep`` or ``spin`` for ``choice`` (one of :data:`WAIT_CHOICES`): ``auto`` is ``spin`` on CPUs
    of the node's own (``own_cpus``) and ``sleep`` otherwise, unless ``OMP_WAIT_POLICY`` is set in
    ``environ`` (default: this process's), which then decides."""
    if choice not in WAIT_CHOICES:
        raise ValueError(f"the update threads' wait must be one of {', '.join(WAIT_CHOICES)}, not {choice!r}")
    if choice != "auto":
        return choice
    policy = (os.environ if environ is None else environ).get(POLICY_ENV, "").strip().lower()
    if policy in ("passive", "active"):
        return "sleep" if policy == "passive" else "spin"
    return "spin" if own_cpus else "sleep"


def apply_update_thread_wait(wait: str) -> bool:
    """Make this process's update threads ``wait`` (``sleep``: ``OMP_WAIT_POLICY=PASSIVE``; ``spin``:
    OpenMP's default, a bounded spin). Returns False where an OpenMP runtime is loaded already (a
    node forked from an interpreter that imported torch), which then keeps the policy it read."""
    if wait not in ("sleep", "spin"):
        raise ValueError(f"wait must be 'sleep' or 'spin', not {wait!r}")
    if openmp_loaded():
        return False
    if wait == "sleep":
        os.environ[POLICY_ENV] = "PASSIVE"
    elif os.environ.get(POLICY_ENV, "").strip().lower() == "passive":
        del os.environ[POLICY_ENV]  # OpenMP's default: spin a while, then sleep (ACTIVE would never sleep)
    return True


def openmp_loaded() -> bool:
    """Whether this process has an OpenMP runtime loaded (it read ``OMP_WAIT_POLICY`` then)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(name in line for line in maps for name in ("libgomp", "libiomp", "libomp"))
    except OSError:  # not Linux: torch's import is what loads it
        return "torch" in sys.modules
