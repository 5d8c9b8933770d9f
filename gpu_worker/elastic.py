"""Elastic jobs: workers leave (preempted, with notice) or join, and the job goes on at the new width.

The whole training state lives on the optimizer nodes, so a worker holds nothing another cannot take
over: changing the data-parallel width is a matter of agreeing on *who* is in the job and *from which
step*, then saying HELLO again (:meth:`gpu_worker.RemoteOptimizer.morph`). The agreement goes through
a ``torch.distributed.Store`` (torchrun's rendezvous store, a ``TCPStore``, or a ``HashStore`` for
threads), with one key read per step while nothing changes.

The protocol, for a membership change numbered ``v`` (a new list of members, old ones first in their
order, joiners after):

- a member that sees ``v`` at the boundary before step ``b`` acknowledges it with ``b + 1`` and trains
  step ``b`` at the old width: another member may have pushed step ``b`` already, and it needs this
  member's gradient of that step too;
- at the boundary before step ``b + 1`` it waits for the acknowledgements of every old member (they all
  reach that boundary: step ``b`` completes) and the job changes its width at ``E``, the largest of them
  (``b + 1`` or ``b + 2``, members being at most a step apart); until ``E`` the old width trains;
- at ``E`` every remaining member morphs (its rank is its place in the new list), a member that asked
  to leave leaves (``Change.leaving``), and a joiner, which waited for ``E``, starts.

No step is lost or repeated and none mixes widths: every node changes the width between steps ``E - 1``
and ``E`` (see :mod:`optimizer_node.intake.morphing`). The data a rank trains on must be a function of the step
and the global sample index (:func:`shard`), so that the result depends on the width schedule only.
A member that dies without notice never acknowledges: the others stop with an error naming it.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "netoptim/elastic"


@dataclass(frozen=True, slots=True)
class Change:
    """What a member does at step ``at_step``: go on as ``rank`` of ``world_size``, or leave."""

    at_step: int
    rank: int
    world_size: int
    leaving: bool = False


def shard(step: int, global_batch: int, rank: int, world_size: int) -> range:
    """The global sample indices rank ``rank`` of ``world_size`` trains on at ``step``: a function of
    the step and the global index only, so a job that changes its width keeps its data order."""
    if global_batch % world_size:
        raise ValueError(f"the global batch of {global_batch} does not split over {world_size} workers: choose a width that divides it")
    per = global_batch // world_size
    first = step * global_batch + rank * per
    return range(first, first + per)


class ElasticGroup:
    """One worker's view of the job's membership, kept in ``store`` under the name ``member``.

    Create the first membership once with :meth:`create` (a launcher, or the first worker); each
    worker then makes an :class:`ElasticGroup` and either :meth:`start` (it is in the list) or
    :meth:`join` (it is not). Call :meth:`at_boundary` before each step.
    """

    def __init__(self, store: Any, member: str, *, timeout_s: float = 120.0) -> None:
        if not member or "/" in member:
            raise ValueError(f"a member name is a non-empty string without '/', got {member!r}")
        self._store = store
        self.member = member
        self.timeout_s = timeout_s
        self.version = -1
        self.members: list[str] = []
        self._acked: dict[int, int] = {}  # version -> the step this member acknowledged it with
        self._agreed: dict[int, int] = {}  # version -> the step it takes effect at
        self._leave_requested = False
        self._leave_proposed = False
        self._followed: Any = None  # an optimizer whose leave_requested this member acts on

    # ---------------------------------------------------------------- membership

    @staticmethod
    def create(store: Any, members: list[str]) -> None:
        """The first membership (version 0). Members' names must be unique."""
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"members must be unique names, got {members}")
        store.set(f"{PREFIX}/v0/members", json.dumps(members))
        store.set(f"{PREFIX}/version", "0")

    def _get(self, key: str) -> bytes:
        self._store.wait([f"{PREFIX}/{key}"], timedelta(seconds=self.timeout_s))
        return self._store.get(f"{PREFIX}/{key}")

    def _latest(self) -> int:
        return int(self._get("version"))

    def _members_of(self, version: int) -> list[str]:
        return json.loads(self._get(f"v{version}/members"))

    def start(self) -> Change:
        """Take the current membership (this member must be in it); the rank and width to start with."""
        self.version = self._latest()
        self.members = self._members_of(self.version)
        if self.member not in self.members:
            raise ValueError(f"{self.member!r} is not a member of the job ({self.members}): join() it instead")
        return Change(-1, self.members.index(self.member), len(self.members))

    def _propose(self, change: str) -> int:
        """Append a new membership: ``change`` is ``join`` or ``leave`` of this member. Returns its version."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            current = self._latest()
            members = self._members_of(current)
            proposed = [*members, self.member] if change == "join" else [m for m in members if m != self.member]
            if change == "join" and self.member in members:
                raise ValueError(f"{self.member!r} is a member of the job already")
            wanted = json.dumps(proposed).encode()
            key = f"{PREFIX}/v{current + 1}/members"
            if self._store.compare_set(key, "", wanted) == wanted:  # this proposal took version current + 1
                self._store.set(f"{PREFIX}/version", str(current + 1))
                log.info("%s: membership %d proposed (%s): %s", self.member, current + 1, change, proposed)
                return current + 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.member}: could not {change} the job within {self.timeout_s:.0f} s")
            time.sleep(0.005)  # another proposal took it: it is published in a moment

    def join(self) -> Change:
        """Join the running job: waits until its members agreed the step it grows at, and returns it."""
        version = self._propose("join")
        at = int(self._get(f"v{version}/at"))
        self.version, self.members = version, self._members_of(version)
        log.info("%s joins as rank %d of %d at step %d", self.member, self.members.index(self.member), len(self.members), at)
        return Change(at, self.members.index(self.member), len(self.members))

    def request_leave(self) -> None:
        """Leave at the next agreed boundary (safe in a signal handler: it only sets a flag)."""
        self._leave_requested = True

    def follow(self, optimizer: Any) -> None:
        """Leave also when an operator asks this worker to (``netoptim admin morph --leave RANK``: the
        node tells ``optimizer``, see :attr:`gpu_worker.RemoteOptimizer.leave_requested`)."""
        self._followed = optimizer

    def leave_on(self, signum: int = signal.SIGTERM) -> None:
        """Preemption with notice: on ``signum`` this member finishes its steps until the agreed boundary and leaves."""
        signal.signal(signum, lambda *_: self.request_leave())

    # ---------------------------------------------------------------- each step

    def at_boundary(self, step: int) -> Change | None:
        """Call before step ``step``: ``None`` to train it at the current width, or the change to make first."""
        if self._followed is not None and self._followed.leave_requested is not None:
            self._leave_requested = True
        if self._leave_requested and not self._leave_proposed:
            self._leave_proposed = True
            self._propose("leave")
        if self._latest() == self.version:
            return None
        version = self.version + 1  # changes are taken one at a time, in order
        acked = self._acked.get(version)
        if acked is None:
            self._store.set(f"{PREFIX}/v{version}/ack/{self.member}", str(step + 1))
            acked = self._acked[version] = step + 1
        if step < acked:
            return None
        at = self._agreed_step(version)
        if step < at:
            return None
        if step != at:
            raise RuntimeError(f"{self.member} is at step {step}, past the agreed step {at} of membership {version}")
        members = self._members_of(version)
        self.version, self.members = version, members
        if self.member not in members:
            log.info("%s leaves the job at step %d", self.member, at)
            return Change(at, -1, len(members), leaving=True)
        change = Change(at, members.index(self.member), len(members))
        log.info("%s is rank %d of %d from step %d", self.member, change.rank, change.world_size, at)
        return change

    def _agreed_step(self, version: int) -> int:
        """The step membership ``version`` takes effect at: the largest acknowledgement of the old members."""
        if version in self._agreed:
            return self._agreed[version]
        keys = [f"{PREFIX}/v{version}/ack/{member}" for member in self.members]
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:
            silent = [m for m, k in zip(self.members, keys, strict=True) if not self._store.check([k])]
            raise RuntimeError(
                f"{self.member}: member(s) {silent} did not acknowledge membership change {version} within {self.timeout_s:.0f} s: they may have "
                "died without notice; restart the job's workers at the width you want (they resume at the nodes' step)"
            ) from None
        at = max(int(self._store.get(key)) for key in keys)
        self._store.compare_set(f"{PREFIX}/v{version}/at", "", str(at))  # for joiners; every member computes the same
        self._agreed[version] = at
        return at
