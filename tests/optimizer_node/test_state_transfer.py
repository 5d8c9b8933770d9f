"""Loading one part of a bucket's state: the values change in place, and what was sent of the old
ones (the cast copy, the parameter board's slot) is known to be stale."""

from __future__ import annotations

import torch

from optimizer_node.state.storage import InMemoryStore
from optimizer_node.state.transfer import load_part
from transport.interface import Message
from transport.wire import Header, MsgType


def _load(store: InMemoryStore, state, part: str, values: torch.Tensor) -> None:
    header = Header(msg_type=MsgType.LOAD_STATE, rank=0, bucket_id=state.bucket_id, step=state.step, numel=values.numel(), meta={"part": part})
    load_part(store, state, Message(peer=b"", header=header, tensors=[(0, values)]), segments=1)


def test_loading_parameters_gives_the_bucket_a_new_revision_and_moments_do_not():
    store = InMemoryStore()
    state = store.create(0, torch.zeros(64))
    other = store.create(1, torch.zeros(64))
    assert state.revision != other.revision  # every bucket's values start as a revision of their own
    first = state.revision
    _load(store, state, "exp_avg", torch.ones(64))
    assert state.revision == first and torch.equal(state.exp_avg, torch.ones(64))
    state.wire_step = state.step
    _load(store, state, "param", torch.full((64,), 0.5))
    assert torch.equal(state.param, torch.full((64,), 0.5))
    assert state.revision != first and state.wire_step == -1
