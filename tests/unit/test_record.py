"""The gather's fixed record: the ctypes writer equals the plain-torch one byte for byte, and reads back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.collectives import _record as record
from ddpkit.collectives._framing import PREFIX, body_offset
from ddpkit.collectives._headers import decode_header, encode_header, tensor_head
from ddpkit.collectives._tensor_records import tensor_placements
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


def test_copies_of_a_record_for_an_all_to_all_are_the_record_again_and_again() -> None:
    head = encode_header({"dtype": "float32", "shape": [2, 3]})
    payload = torch.arange(6.0).reshape(2, 3)
    once = record.write_plain(head, payload, 24, 128)
    assert torch.equal(record.write(head, payload, 24, 128, copies=3), once.repeat(3))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128])
@pytest.mark.parametrize("ndim", [0, 1, 2, 16])
def test_a_tensors_head_is_the_compact_header_of_its_dtype_and_shape(dtype: torch.dtype, ndim: int) -> None:
    tensor = torch.zeros([2] * min(ndim, 2) + [1] * max(0, ndim - 2), dtype=dtype)
    head = tensor_head(tensor)
    assert head == encode_header({"dtype": str(dtype).removeprefix("torch."), "shape": list(tensor.shape)})
    assert head is not None
    assert decode_header(head)["shape"] == list(tensor.shape)


def test_a_tensor_the_compact_form_does_not_hold_has_no_head() -> None:
    assert tensor_head(torch.zeros(2, dtype=torch.uint16)) is None
    assert tensor_head(torch.zeros([1] * 17)) is None


def _records(tensors: list[torch.Tensor | None], capacity: int, heads: list[bytes] | None = None) -> torch.Tensor:
    written = []
    for r, tensor in enumerate(tensors):
        head = heads[r] if heads else tensor_head(tensor) if tensor is not None else encode_header({"error": ["x"]})
        assert head is not None
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        written.append(record.write(head, tensor, nbytes, capacity))
    return torch.cat(written)


def test_tensor_placements_find_every_ranks_tensor_in_place() -> None:
    tensors = [torch.arange(4.0).reshape(1, 4), torch.arange(12.0).reshape(3, 4) + 10, torch.empty(0, 4)]
    records = _records(tensors, 256)
    head = tensor_head(tensors[0])
    assert head is not None
    placements = tensor_placements(record.memory_of(records), 256, head, same_shape=False)
    assert placements is not None
    typed = records.view(torch.float32)
    for r, (shape, start, nbytes) in enumerate(placements):
        assert (list(shape), nbytes, start % 16) == (list(tensors[r].shape), tensors[r].numel() * 4, 0)
        got = typed[start // 4 : start // 4 + nbytes // 4].reshape(list(shape))
        assert torch.equal(got, tensors[r])


@pytest.mark.parametrize(
    ("others", "capacity", "same_shape"),
    [
        ([torch.zeros(3, 4, dtype=torch.float64)], 256, False),  # another dtype
        ([torch.zeros(3)], 256, False),  # another number of dimensions
        ([torch.zeros(3, 4)], 256, True),  # another shape where shapes must be equal
        ([torch.zeros(60, 4)], 256, False),  # too large to ride in its record
        ([None], 256, False),  # a rank that sent an error instead
    ],
)
def test_tensor_placements_leave_every_other_case_to_the_full_reading(
    others: list[torch.Tensor | None], capacity: int, same_shape: bool
) -> None:
    mine = torch.zeros(2, 4)
    head = tensor_head(mine)
    assert head is not None
    records = _records([mine, *others], capacity)
    assert tensor_placements(record.memory_of(records), capacity, head, same_shape) is None
