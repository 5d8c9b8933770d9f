"""The parameters an out-of-core node read from its files to answer fetches, kept while its memory
budget has room for them.

In a layer-wise job every rank fetches every unit twice a step (for forward and for backward), and
the ranks fetch the same unit within moments of each other. A bucket whose state is not resident is
answered from the parameter third of its file; without these, every rank's fetch reads it again (two
workers: 2.1x the state read a step instead of 1x plus the thirds). An entry holds one version's
values: the store drops it whenever the bucket's state may change (it is acquired, created or
restored), and an entry of another version is never returned. Entries take only what the budget has
left: the store gives them up, oldest first, before it evicts any state.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class FetchedParams:
    """Bucket id -> (the step of the version read, its parameters), least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()
        self.nbytes = 0  # of the values kept
        self.hits = 0  # fetches answered from here: reads of a file saved

    def get(self, bucket_id: int, step: int) -> torch.Tensor | None:
        """The parameters of ``bucket_id``'s version of ``step``, if kept."""
        entry = self._entries.get(bucket_id)
        if entry is None:
            return None
        if entry[0] != step:
            self.drop(bucket_id)
            return None
        self._entries.move_to_end(bucket_id)
        self.hits += 1
        return entry[1]

    def keep(self, bucket_id: int, step: int, values: torch.Tensor, *, room: int) -> None:
        """Keep ``values`` (``bucket_id``'s parameters of ``step``, not to be changed by anyone) if
        they fit in ``room`` bytes, giving up older entries for them."""
        self.drop(bucket_id)
        needed = values.numel() * values.element_size()
        while self._entries and self.nbytes + needed > room:
            self.drop_oldest()
        if self.nbytes + needed <= room:
            self._entries[bucket_id] = (step, values)
            self.nbytes += needed

    def drop(self, bucket_id: int) -> None:
        entry = self._entries.pop(bucket_id, None)
        if entry is not None:
            self.nbytes -= entry[1].numel() * entry[1].element_size()

    def drop_oldest(self) -> bool:
        """Give up the least recently used entry (a send still reading it keeps it alive until it
        is done); False if there is none."""
        if not self._entries:
            return False
        self.drop(next(iter(self._entries)))
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
