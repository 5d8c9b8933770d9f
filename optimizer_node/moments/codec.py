"""One bucket's moments in the job's format: which of its segments are compressed, where each part
lives in the encoded bytes, and the conversion both ways.

A moment of a bucket is one tensor, whatever the format:

* ``fp32``: the fp32 values themselves (``numel`` of them), as torch keeps them;
* ``bf16``: uint8 bytes: the compressed segments' values as bf16, back to back, then the other
  segments' values as fp32;
* ``8bit``: uint8 bytes: the compressed segments' codes (one byte each), then one fp32 scale per
  block of ``block`` elements, then the other segments' values as fp32.

A segment (one parameter's piece in the bucket) is compressed when it has at least
:data:`MIN_COMPRESSED` elements and a whole number of blocks (``block`` for 8 bits, a 64-element
vector for bf16): small tensors (biases, norms) stay fp32, as bitsandbytes and torchao keep them,
and every compressed element takes the vector path of the update. Blocks start at the segment's
first element, so a parameter in one piece is quantized exactly as torchao quantizes it.

The first moment is signed, the second unsigned (its own map, twice the resolution). A fresh state
is all zero bytes: codes 0 with scale 0, which reads as zeros (the sign of zero aside), as
torchao's zero state does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from optimizer_node.moments.dynamic_map import dequantize, quantize
from optimizer_node.moments.sizes import MIN_COMPRESSED, bytes_per_element  # noqa: F401  (re-exported)
from protos.job.placement import BucketSpec
from protos.job.spec import JobSpec

BF16_UNIT = 64
"""A bf16 segment's elements are a multiple of this: the update's vector, so none takes its scalar tail."""

SCALE_FLOOR = 1e-12
"""The smallest block scale: an all-zero block divides by this, not by zero (torchao's clip)."""

SIGNED = {"exp_avg": True, "exp_avg_sq": False}
"""Whether each moment's map is signed."""


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """Where one segment's moment lives in the encoded bytes."""

    offset: int  # in the bucket (elements)
    numel: int
    compressed: bool
    at: int  # compressed: index of its first element among the compressed ones; else among the plain ones


@dataclass(frozen=True)
class MomentCodec:
    """The layout and conversions of one bucket's moments in format ``format`` (not ``fp32``)."""

    format: str
    block: int
    segments: tuple[tuple[int, int], ...]
    layouts: tuple[SegmentLayout, ...] = field(init=False)
    compressed_numel: int = field(init=False)
    plain_numel: int = field(init=False)
    _rows: dict[int, np.ndarray] = field(init=False, default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.format not in ("bf16", "8bit"):
            raise ValueError(f"a codec is for the compressed formats bf16 and 8bit, not {self.format!r}")
        unit = self.block if self.format == "8bit" else BF16_UNIT
        layouts = []
        packed = plain = 0
        for offset, numel in self.segments:
            compressed = numel >= MIN_COMPRESSED and numel % unit == 0
            layouts.append(SegmentLayout(offset, numel, compressed, packed if compressed else plain))
            if compressed:
                packed += numel
            else:
                plain += numel
        object.__setattr__(self, "layouts", tuple(layouts))
        object.__setattr__(self, "compressed_numel", packed)
        object.__setattr__(self, "plain_numel", plain)

    @property
    def numel(self) -> int:
        return self.compressed_numel + self.plain_numel

    @property
    def blocks(self) -> int:
        """Scales of one 8-bit moment (0 in bf16)."""
        return self.compressed_numel // self.block if self.format == "8bit" else 0

    @property
    def _values_bytes(self) -> int:
        """Bytes of the compressed values (codes or bf16), padded to 4 so the fp32 parts are aligned."""
        size = self.compressed_numel * (1 if self.format == "8bit" else 2)
        return -(-size // 4) * 4

    @property
    def moment_bytes(self) -> int:
        """Bytes of one encoded moment."""
        return self._values_bytes + 4 * self.blocks + 4 * self.plain_numel

    def zeros(self) -> torch.Tensor:
        """A fresh moment: all zero bytes."""
        return torch.zeros(self.moment_bytes, dtype=torch.uint8)

    def parts(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of an encoded moment: the compressed values (uint8 codes, or bf16), the scales (fp32;
        empty in bf16) and the plain values (fp32)."""
        if encoded.dtype != torch.uint8 or encoded.numel() != self.moment_bytes:
            raise ValueError(f"an encoded {self.format} moment of this bucket is {self.moment_bytes} bytes of uint8, got {encoded.numel()} of {encoded.dtype}")
        head = self._values_bytes
        if self.format == "8bit":
            values = encoded[: self.compressed_numel]
        else:
            values = encoded[: 2 * self.compressed_numel].view(torch.bfloat16)
        scales = encoded[head : head + 4 * self.blocks].view(torch.float32)
        plain = encoded[head + 4 * self.blocks :].view(torch.float32)
        return values, scales, plain

    # ---------------------------------------------------------------- one segment

    def decode_segment(self, index: int, encoded: torch.Tensor, signed: bool) -> torch.Tensor:
        """Segment ``index``'s moment as fp32 (a new tensor, or for a plain segment a view to update in place)."""
        layout = self.layouts[index]
        values, scales, plain = self.parts(encoded)
        if not layout.compressed:
            return plain[layout.at : layout.at + layout.numel]
        window = values[layout.at : layout.at + layout.numel]
        if self.format == "bf16":
            return window.to(torch.float32)
        first = layout.at // self.block
        block_scales = scales[first : first + layout.numel // self.block]
        return (dequantize(window, signed).view(-1, self.block) * block_scales.view(-1, 1)).view(-1)

    def encode_segment(self, index: int, moment: torch.Tensor, encoded: torch.Tensor, signed: bool) -> None:
        """Store segment ``index``'s fp32 ``moment`` (what :meth:`decode_segment` gave, updated)."""
        layout = self.layouts[index]
        values, scales, plain = self.parts(encoded)
        if not layout.compressed:
            target = plain[layout.at : layout.at + layout.numel]
            if target.data_ptr() != moment.data_ptr():
                target.copy_(moment)
            return
        window = values[layout.at : layout.at + layout.numel]
        if self.format == "bf16":
            window.copy_(moment)  # round to nearest even
            return
        blocks = moment.view(-1, self.block)
        scale = blocks.abs().amax(dim=1).clamp_(min=SCALE_FLOOR)
        first = layout.at // self.block
        scales[first : first + len(scale)] = scale
        window.copy_(quantize((blocks / scale.view(-1, 1)).view(-1), signed))

    # ---------------------------------------------------------------- the whole bucket

    def decode(self, encoded: torch.Tensor, signed: bool) -> torch.Tensor:
        """The bucket's moment as fp32 (a new tensor of ``numel``)."""
        out = torch.empty(self.numel, dtype=torch.float32)
        for index, layout in enumerate(self.layouts):
            out[layout.offset : layout.offset + layout.numel] = self.decode_segment(index, encoded, signed)
        return out

    def encode(self, moment: torch.Tensor, encoded: torch.Tensor, signed: bool) -> None:
        """Store the bucket's fp32 ``moment`` (``numel`` values) in ``encoded``."""
        if moment.numel() != self.numel:
            raise ValueError(f"the bucket's moment has {self.numel} values, got {moment.numel()}")
        for index, layout in enumerate(self.layouts):
            self.encode_segment(index, moment[layout.offset : layout.offset + layout.numel].to(torch.float32), encoded, signed)

    def rows(self, unit: int) -> np.ndarray:
        """``(bucket offset, compressed index, length)`` of every piece of at most ``unit`` elements of
        the compressed segments, in bucket order (int64, shape ``(n, 3)``): the compiled update's work
        list, made once per codec and unit (a bucket's update reads it every step)."""
        found = self._rows.get(unit)
        if found is None:
            pieces = []
            for layout in self.layouts:
                if layout.compressed:
                    starts = np.arange(0, layout.numel, unit, dtype=np.int64)
                    lengths = np.minimum(unit, layout.numel - starts)
                    pieces.append(np.stack([layout.offset + starts, layout.at + starts, lengths], axis=1))
            found = self._rows[unit] = np.concatenate(pieces) if pieces else np.zeros((0, 3), dtype=np.int64)
        return found


@functools.lru_cache(maxsize=4096)
def codec_for(format: str, block: int, segments: tuple[tuple[int, int], ...]) -> MomentCodec | None:
    """The codec of a bucket with these segments, or ``None`` for fp32 moments (torch's own layout)."""
    return None if format == "fp32" else MomentCodec(format, block, segments)


def moment_bytes(codec: MomentCodec | None, numel: int) -> int:
    """Bytes of one moment of a bucket of ``numel`` elements."""
    return 4 * numel if codec is None else codec.moment_bytes


def describe_moments(spec: JobSpec) -> str:
    """How a job's moments are stored, for status and logs: ``fp32``, ``bf16`` or ``8bit, blocks of 256``."""
    return f"8bit, blocks of {spec.moment_block}" if spec.moments == "8bit" else spec.moments


def bucket_state_bytes(spec: JobSpec, bucket: BucketSpec) -> int:
    """Bytes of a bucket's state on a node: fp32 parameters and both moments in the job's format."""
    codec = codec_for(spec.moments, spec.moment_block, tuple((seg.bucket_offset, seg.numel) for seg in bucket.segments))
    return 4 * bucket.numel + 2 * moment_bytes(codec, bucket.numel)
