"""The gather's fixed record: the ctypes writer equals the plain-torch one byte for byte, and reads back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.collectives import _record as record
from ddpkit.collectives._framing import PREFIX, body_offset
from ddpkit.collectives._transport import decode_header, encode_header
from ddpkit.errors import DDPKitError


@given(
    header=st.dictionaries(st.sampled_from(["kind", "keys", "n"]), st.integers(0, 10**6), max_size=3),
    payload=st.binary(max_size=300),
    capacity=st.sampled_from([64, 128, 1024]),
)
def test_the_ctypes_record_equals_the_plain_torch_one_and_reads_back(
    header: dict[str, int], payload: bytes, capacity: int
) -> None:
    head = encode_header(header)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    fast = record.write(head, data, len(payload), capacity)
    plain = record.write_plain(head, data, len(payload), capacity)
    assert fast.shape == (capacity,)
    assert torch.equal(fast, plain)
    (view,) = record.read_all(fast, capacity, decode_header)
    assert (view.header_bytes, view.payload_bytes) == (len(head), len(payload))
    fits_head = PREFIX.size + len(head) <= capacity
    assert view.header == (header if fits_head else None)
    assert view.payload_inline == (fits_head and body_offset(len(head)) + len(payload) <= capacity)
    if view.payload_inline:
        assert record.host_bytes(fast[view.payload_offset : view.payload_offset + len(payload)]) == payload


def test_several_ranks_records_read_in_place_and_a_foreign_one_is_named() -> None:
    capacity = 128
    records = torch.cat(
        [record.write(encode_header({"rank": r}), torch.arange(r, dtype=torch.uint8), r, capacity) for r in range(3)]
    )
    views = record.read_all(records, capacity, decode_header)
    assert [v.header for v in views] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    records[capacity : capacity + 2] = 0  # rank 1 sent something else
    with pytest.raises(DDPKitError, match=r"rank 1 sent something other than a ddpkit record"):
        record.read_all(records, capacity, decode_header)


def test_a_tensor_descriptor_header_is_compact() -> None:
    """Tensor headers ({dtype, shape}) take a few bytes, so more of a small payload rides in the record."""
    head = encode_header({"dtype": "float32", "shape": [4, 8]})
    assert len(head) == 3 + 2 * 8
    assert decode_header(head) == {"dtype": "float32", "shape": [4, 8]}
