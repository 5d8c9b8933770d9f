"""A layer-wise CPU worker computes from a same-host node's parameter board in place: its parameters
are views of the board while their unit is held, the training is bitwise what copies give, and a
node that broke the board's promise is an error, not torn values."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import offload
from gpu_worker.layerwise.board_aliases import BoardAliases
from protos.job.placement import ParamSpec, plan_buckets
from tests.gpu_worker.test_layerwise import make_gpt, tokens
from transport.interface import Message
from transport.payload_views import board_payload_views
from transport.shm.board import BoardPublisher, BoardReader, board_bytes
from transport.shm.window import window_holding
from transport.wire import MsgType, tensor_header

CHUNK = 256  # bytes a chunk: every test payload spans several chunks


def _train(node_address: str, steps: int = 3, **options: object) -> tuple[dict[str, torch.Tensor], list[bool], int]:
    """One worker, layer-wise; returns its final parameters, whether each block parameter lay in a
    read-only shared window at each block's forward, and the bytes it held between steps."""
    model = make_gpt()
    options = {"bucket_numel": 1 << 16, **options}
    opt = offload(model, model.blocks, nodes=[node_address], prefetch=1, lr=3e-3, weight_decay=0.1, timeout_s=60, **options)
    in_board: list[bool] = []

    def probe(block: torch.nn.Module, _args: object) -> None:
        for p in block.parameters():
            window = window_holding(p.data_ptr(), p.numel() * p.element_size())
            in_board.append(window is not None and not window.writable)

    probes = [block.register_forward_pre_hook(probe) for block in model.blocks]
    held_between = 0
    for step in range(steps):
        _logits, loss = model(*tokens(step, 0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        held_between = max(held_between, opt._streamer.resident_param_bytes())
    for handle in probes:
        handle.remove()
    values = opt.gather_parameters()
    opt.close()
    return values, in_board, held_between


def test_a_cpu_worker_computes_from_the_board_and_trains_as_copies_do(start_node):
    from_board, in_board, held_between = _train(start_node("board").address)
    copied, in_window, _ = _train(start_node("plain", extra_args=("--no-same-host-board",)).address)
    assert in_board and all(in_board), "every block parameter is a view of the node's board while its block computes"
    assert not any(in_window), "without a board, values are copied into the worker's own memory"
    assert held_between == 0, "between steps the worker holds no parameters, and views none"
    assert from_board.keys() == copied.keys()
    for name in copied:
        assert torch.equal(from_board[name], copied[name]), f"{name} differs between in-place and copied values"


def test_no_block_parameter_is_split_between_buckets_so_every_one_is_a_view(start_node):
    """4096-element buckets cut three of each block's parameters in two in the first layout (a worker
    copies those out of the board); layer-wise jobs take the second, where none is cut and those
    three are views, and the values are bitwise those of the first. (A bias alone in a bucket of its
    own is sent with other small buckets, copied, in either layout.)"""
    names = [name for name, _ in make_gpt().blocks[0].named_parameters()]
    whole, in_board, _ = _train(start_node("whole").address, bucket_numel=4096)
    split, in_board_split, _ = _train(start_node("split").address, bucket_numel=4096, bucket_layout=1)
    copied = {names[i % len(names)] for i, view in enumerate(in_board) if not view}
    copied_split = {names[i % len(names)] for i, view in enumerate(in_board_split) if not view}
    assert {"attn.proj.weight", "mlp.0.weight", "mlp.2.weight"} <= copied_split, copied_split
    assert not any(name.endswith("weight") for name in copied), copied
    for name in split:
        assert torch.equal(whole[name], split[name]), f"{name} differs between the layouts"


@pytest.fixture
def board():
    publisher = BoardPublisher(board_bytes([4096, 4096]), "netoptim-test-aliases")
    reader = BoardReader.open(publisher.describe())
    yield publisher, reader
    reader.close()
    publisher.window.close()


def _layout() -> tuple[list[torch.Tensor], list]:
    params = [torch.nn.Parameter(torch.zeros(8, 16)), torch.nn.Parameter(torch.zeros(16))]
    for p in params:
        p.data.untyped_storage().resize_(0)  # as a layer-wise worker holds them between uses
    specs = [ParamSpec(f"p{i}", tuple(p.shape), "float32", 0) for i, p in enumerate(params)]
    return params, plan_buckets(specs, 1024, 1)


def _message(publisher: BoardPublisher, reader: BoardReader, values: torch.Tensor, version: int) -> Message:
    header = tensor_header(MsgType.PARAMS, values, chunk_bytes=CHUNK, bucket_id=0, step=version)
    lengths = [min(CHUNK, values.numel() * 4 - offset) for offset in range(0, values.numel() * 4, CHUNK)]
    slot = publisher.reference(0, version, [values], lengths)
    assert slot is not None
    payload, current, release = reader.read(slot, header.payload_bytes)
    views = board_payload_views(header, payload, max_bytes=1 << 20)
    return Message(peer=b"", header=header, tensors=views, still_current=current, release=release)


def test_parameters_view_the_board_and_a_rewritten_slot_is_an_error(board):
    publisher, reader = board
    params, buckets = _layout()
    aliases = BoardAliases(params, buckets, torch.float32, enabled=True)
    values = torch.arange(144, dtype=torch.float32)
    message = _message(publisher, reader, values, version=1)
    assert message.header.num_chunks > 1 and len(message.tensors) == 1, "chunks on the wire, one view of the board: a parameter may cross chunks"
    assert list(aliases.install(buckets[0], message, step=1)) == []
    aliases.hold(0, message, "node0")
    assert torch.equal(params[0].detach().view(-1), values[:128]) and torch.equal(params[1].detach(), values[128:])
    assert aliases.viewing == {0, 1} and all(window_holding(p.data_ptr(), p.numel() * 4) is reader.window for p in params)
    publisher.reference(0, 2, [torch.zeros(144)], [576])  # the node broke its promise: a new version while read
    with pytest.raises(RuntimeError, match="restart the worker"):
        aliases.check(0)
    for index, param in enumerate(params):
        assert aliases.release(index)
        assert param.shape == ((8, 16), (16,))[index] and param.untyped_storage().nbytes() == 0, "its own storage again, empty"
    assert aliases.viewing == set()


def test_a_parameter_copied_this_step_stays_copied(board):
    """The tensors autograd saved from a copy refer to the parameter's own storage, which a later
    fetch of the same step must refill, not replace."""
    publisher, reader = board
    params, buckets = _layout()
    aliases = BoardAliases(params, buckets, torch.float32, enabled=True)
    values = torch.arange(144, dtype=torch.float32)
    socket_message = Message(peer=b"", header=tensor_header(MsgType.PARAMS, values, bucket_id=0, step=1), tensors=[(0, values)])
    assert list(aliases.install(buckets[0], socket_message, step=1)) == list(buckets[0].segments), "a socket's frames are the worker's: copied"
    aliases.will_copy(0, step=1)
    left = aliases.install(buckets[0], _message(publisher, reader, values, version=1), step=1)
    assert [seg.param_index for seg in left] == [0], "p0 was copied this step: copied again; p1 is viewed"
    assert aliases.viewing == {1}
    assert list(aliases.install(buckets[0], _message(publisher, reader, values, version=2), step=2)) == []
    assert aliases.viewing == {0, 1}


def test_nothing_is_viewed_where_the_wire_dtype_differs_or_on_a_device(board):
    publisher, reader = board
    params, buckets = _layout()
    message = _message(publisher, reader, torch.arange(144, dtype=torch.float32), version=1)
    for aliases in (BoardAliases(params, buckets, torch.bfloat16, enabled=True), BoardAliases(params, buckets, torch.float32, enabled=False)):
        assert list(aliases.install(buckets[0], message, step=1)) == list(buckets[0].segments)
        assert aliases.viewing == set()
