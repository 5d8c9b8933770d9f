"""The workers of one host exchange gradients and parameters through shared memory (MiCS's lesson:
reduce inside the small, fast group first, then send one flow per host).

A host group of ``local_size`` workers shares one file in ``/dev/shm``: a gradient slot per follower,
the parameters, and a few counters. Each step, every follower copies its flat gradient into its slot
and bumps its counter; the leader (local rank 0) adds the slots to its own gradient in local-rank
order, so the host's sum is ``((g0 + g1) + g2) + ...``, the same on every run. Gradients may also go
piece by piece (one piece a parameter, as backward finishes it), each piece with its own counter, so the
leader adds and pushes the first pieces while backward still computes the rest. After the nodes' update
the leader copies the new parameters into the shared area and bumps the parameters' counter; the
followers copy them out. Only the leader talks to the optimizer nodes.

Waits poll the counters (sleeping 50 us between looks) and stop with an error after ``timeout_s``,
naming who did not arrive: a member that died takes the group down with a clear message, not a hang.
A counter is written after the data it announces; on x86 stores become visible in program order,
and elsewhere the interpreter's lock round trip between the two writes orders them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

POLL_S = 50e-6


@dataclass(frozen=True, slots=True)
class HostGroup:
    """Who this worker is in its host's group: ``name`` is the same for the group's members and unique
    on the host (for example the job's name and the host's index)."""

    name: str
    local_rank: int
    local_size: int
    directory: str = "/dev/shm"

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"a host group's name is a non-empty string without '/', got {self.name!r}")
        if not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local_rank {self.local_rank} is not in [0, {self.local_size})")

    @property
    def leader(self) -> bool:
        return self.local_rank == 0


class HostExchange:
    """The shared area of one host group, for flat fp32 gradients and parameters of ``numel`` elements."""

    def __init__(self, group: HostGroup, numel: int, timeout_s: float, pieces: int = 0) -> None:
        self.group = group
        self.numel = numel
        self.timeout_s = timeout_s
        self.pieces = pieces
        size = group.local_size
        self._data_path = Path(group.directory) / f"netoptim-host-{group.name}.data"
        self._ctrl_path = Path(group.directory) / f"netoptim-host-{group.name}.ctrl"
        if group.leader:  # made afresh: a file left by an earlier run must not be read as this one's
            for path in (self._data_path, self._ctrl_path):
                path.unlink(missing_ok=True)
            self._ctrl_path.with_suffix(".tmp").write_bytes(bytes(8 * (size + 2 + size * pieces)))
            self._data_path.write_bytes(b"")
            os.truncate(self._data_path, 4 * numel * size)
            os.replace(self._ctrl_path.with_suffix(".tmp"), self._ctrl_path)  # followers attach once both exist
        else:
            self._wait(lambda: self._ctrl_path.exists(), f"the leader of host group {group.name!r} to create {self._ctrl_path}")
            if self._ctrl_path.stat().st_size != 8 * (size + 2 + size * pieces):  # the leader's layout, or another
                raise ValueError(
                    f"host group {group.name!r}: the leader exchanges gradients otherwise than local rank {group.local_rank} "
                    "(give every member the same parameters and the same push_during_backward)"
                )
        data = torch.from_file(str(self._data_path), shared=True, size=numel * size, dtype=torch.float32)
        self._slots = data.view(size, numel)  # slot 0: the parameters (the leader's own gradient stays with it)
        self._ctrl = torch.from_file(str(self._ctrl_path), shared=True, size=size + 2 + size * pieces, dtype=torch.int64)
        # ctrl[r], r >= 1: the step whose gradient follower r published; ctrl[0]: the step whose
        # parameters the leader published; ctrl[size]: the nodes' step then; ctrl[size + 1]: an error flag;
        # then one counter per follower and piece: the step whose piece it published.
        self._piece_seq = self._ctrl[size + 2 :].view(size, pieces)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if self._failed():
                raise RuntimeError(f"host group {self.group.name!r}: another member stopped with an error while this one waited for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"host group {self.group.name!r}, local rank {self.group.local_rank}: waited {self.timeout_s:.0f} s for {what}")
            time.sleep(POLL_S)

    def _failed(self) -> bool:
        return hasattr(self, "_ctrl") and int(self._ctrl[self.group.local_size + 1]) != 0

    def fail(self) -> None:
        """Tell the other members this one stopped with an error (they stop at once instead of timing out)."""
        self._ctrl[self.group.local_size + 1] = 1

    # ---------------------------------------------------------------- followers

    def publish_gradient(self, flat: torch.Tensor, seq: int) -> None:
        """The follower's gradient of ``seq``. Its slot is free: the leader read the one of ``seq - 1``
        before it published the parameters of ``seq - 1``, which this follower took before computing."""
        rank = self.group.local_rank
        self._slots[rank].copy_(flat)
        self._ctrl[rank] = seq

    def publish_piece(self, piece: int, offset: int, gradient: torch.Tensor, seq: int) -> None:
        """One piece of the follower's gradient of ``seq`` (elements ``offset`` on of its flat gradient).
        Its place is free for the reason :meth:`publish_gradient` gives."""
        rank = self.group.local_rank
        self._slots[rank, offset : offset + gradient.numel()].copy_(gradient.reshape(-1))
        self._piece_seq[rank, piece] = seq

    def take_parameters(self, flat: torch.Tensor, seq: int) -> int:
        """The parameters the leader published for ``seq``, into ``flat``; returns the nodes' step."""
        self._wait(lambda: int(self._ctrl[0]) >= seq, f"the leader's parameters of step {seq}")
        flat.copy_(self._slots[0])
        return int(self._ctrl[self.group.local_size])

    # ---------------------------------------------------------------- the leader

    def add_gradients(self, flat: torch.Tensor, seq: int) -> None:
        """Add the followers' gradients of ``seq`` to ``flat`` (the leader's own), in local-rank order."""
        for rank in range(1, self.group.local_size):
            self._wait(lambda rank=rank: int(self._ctrl[rank]) >= seq, f"local rank {rank}'s gradient of step {seq}")
            flat.add_(self._slots[rank])

    def add_piece(self, piece: int, offset: int, gradient: torch.Tensor, seq: int) -> None:
        """Add the followers' piece ``piece`` of ``seq`` to ``gradient`` (the leader's own), in local-rank
        order: element by element the sum :meth:`add_gradients` makes."""
        for rank in range(1, self.group.local_size):
            self._wait(lambda rank=rank: int(self._piece_seq[rank, piece]) >= seq, f"local rank {rank}'s gradient piece {piece} of step {seq}")
            gradient.add_(self._slots[rank, offset : offset + gradient.numel()].view(gradient.shape))

    def publish_parameters(self, flat: torch.Tensor, seq: int, remote_step: int) -> None:
        # Every follower's gradient of seq has been read (add_gradients) before the parameters go out.
        self._slots[0].copy_(flat)
        self._ctrl[self.group.local_size] = remote_step
        self._ctrl[0] = seq

    def close(self) -> None:
        if self.group.leader:
            for path in (self._data_path, self._ctrl_path):
                path.unlink(missing_ok=True)
