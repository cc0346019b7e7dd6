"""Unit tests for swarm.compression: error bounds, exact sizes, segmenting, pass-through, NaN/Inf, bad payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import relative_error, sample_tensor

from swarm.compression import (
    BYTES_PER_VALUE,
    CODEC_NAMES,
    WIRE_DTYPE_NAMES,
    CodecError,
    UnknownCodecError,
    dtype_from_name,
    get_codec,
    segment_ranges,
    wire_dtype_name,
)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
NUMEL = 1 << 16


# --- round-trip error bounds ---------------------------------------------------------------------------------------

# upper bounds on ||x - dec(enc(x))|| / ||x|| for float32 inputs; measured values are ~2/3 of these
ERROR_BOUNDS = {
    ("none", "normal"): 0.0,
    ("none", "student_t2"): 0.0,
    ("none", "lognormal"): 0.0,
    ("fp16", "normal"): 3e-4,
    ("fp16", "student_t2"): 3e-4,
    ("fp16", "lognormal"): 3e-4,
    ("bf16", "normal"): 2.5e-3,
    ("bf16", "student_t2"): 2.5e-3,
    ("bf16", "lognormal"): 2.5e-3,
    ("int8", "normal"): 7e-3,
    ("int8", "student_t2"): 1.5e-2,
    ("int8", "lognormal"): 1.2e-2,
    # 4 and 2 bits (swarm/compression/lowbit.py); lognormal data is all positive, so half of the symmetric grid
    # goes unused there. Stochastic rounding trades a larger error for no bias (tests/test_lowbit.py).
    ("int4", "normal"): 0.1,
    ("int4", "student_t2"): 0.15,
    ("int4", "lognormal"): 0.16,
    ("int2", "normal"): 0.37,
    ("int2", "student_t2"): 0.41,
    ("int2", "lognormal"): 0.53,
    ("int4sr", "normal"): 0.14,
    ("int4sr", "student_t2"): 0.24,
    ("int4sr", "lognormal"): 0.24,
    ("int2sr", "normal"): 0.48,
    ("int2sr", "student_t2"): 0.83,
    ("int2sr", "lognormal"): 0.93,
}


@pytest.mark.parametrize(("codec_name", "distribution"), sorted(ERROR_BOUNDS))
def test_round_trip_error_is_bounded(codec_name: str, distribution: str) -> None:
    codec = get_codec(codec_name)
    flat = sample_tensor(distribution)
    decoded = codec.decode(codec.encode(flat), flat.numel(), flat.dtype)
    assert decoded.shape == flat.shape and decoded.dtype == flat.dtype
    error = relative_error(flat, decoded)
    assert error <= ERROR_BOUNDS[codec_name, distribution]
    if codec_name == "none":
        assert torch.equal(decoded, flat)


@pytest.mark.parametrize("distribution", ["normal", "student_t2", "lognormal"])
def test_int8_error_per_element_is_half_a_step_of_its_block(distribution: str) -> None:
    codec = get_codec("int8")
    block = codec.segment_alignment
    flat = sample_tensor(distribution, numel=block * 1000)
    decoded = codec.decode(codec.encode(flat), flat.numel(), flat.dtype)
    absmax = flat.view(-1, block).abs().amax(dim=1, keepdim=True)  # (nb, 1)
    error = (flat - decoded).view(-1, block).abs()  # (nb, b)
    # half a quantization step; the bfloat16 scale is rounded up by less than 2**-7, float32 math adds a few ulps
    assert bool((error <= absmax / 127 / 2 * (1 + 2**-7) * (1 + 1e-5)).all())
    # the maximum of each block is reproduced to float32 rounding: the scale never clips it
    maxima = flat.view(-1, block).abs().argmax(dim=1, keepdim=True)
    assert torch.allclose(
        decoded.view(-1, block).gather(1, maxima), flat.view(-1, block).gather(1, maxima), rtol=5e-3
    )


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_every_float_dtype_round_trips_to_its_own_dtype(
    codec_name: str, dtype: torch.dtype
) -> None:
    codec = get_codec(codec_name)
    flat = sample_tensor("normal", numel=1000).to(dtype)
    decoded = codec.decode(codec.encode(flat), flat.numel(), dtype)
    assert decoded.dtype == dtype
    # the codec's own bound on normal data (1000 samples: 10% slack), or 7e-3 for the 8- and 16-bit ones, whose
    # error here is mostly the input's own rounding to 16 bits
    assert relative_error(flat, decoded) <= max(7e-3, 1.1 * ERROR_BOUNDS[codec_name, "normal"])


@pytest.mark.parametrize("codec_name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sixteen_bit_inputs_travel_raw_in_sixteen_bit_codecs(
    codec_name: str, dtype: torch.dtype
) -> None:
    codec = get_codec(codec_name)
    flat = sample_tensor("normal", numel=1000).to(dtype)
    payload = codec.encode(flat)
    assert payload == flat.view(torch.uint8).numpy().tobytes()
    assert torch.equal(codec.decode(payload, flat.numel(), dtype), flat)


def test_int8_keeps_tiny_gradients_and_zero_blocks() -> None:
    codec = get_codec("int8")
    block = codec.segment_alignment
    # far below float16's range, inside bfloat16's
    tiny = sample_tensor("normal", numel=block) * 1e-30
    flat = torch.cat([tiny, torch.zeros(block), torch.tensor([0.0, -0.0])])  # (2b + 2,)
    decoded = codec.decode(codec.encode(flat), flat.numel(), flat.dtype)
    assert relative_error(tiny, decoded[:block]) <= 7e-3
    assert torch.equal(decoded[block:], torch.zeros(block + 2))


def test_int8_blocks_of_any_magnitude_encode_the_same_alone_or_together() -> None:
    codec = get_codec("int8")
    block = codec.segment_alignment
    # magnitudes from float32 subnormals to near the bfloat16 maximum, one block each, plus a short tail
    magnitudes = [1e-44, 1e-40, 1e-37, 1e-31, 1e-12, 1.0, 1e20, 1e38]
    flat = torch.cat(
        [sample_tensor("normal", numel=block, seed=i) * m for i, m in enumerate(magnitudes)]
        + [torch.ones(3)]
    )
    whole = codec.encode(flat)
    assert (
        b"".join(
            codec.encode(flat[start : start + block]) for start in range(0, flat.numel(), block)
        )
        == whole
    )
    decoded = codec.decode(whole, flat.numel(), torch.float32)
    # normal float32 range: relative precision holds
    for index, magnitude in enumerate(magnitudes[2:], start=2):
        piece = slice(index * block, (index + 1) * block)
        assert relative_error(flat[piece], decoded[piece]) < 1e-2, magnitude
    # subnormal blocks keep only what float32 can hold, but never blow up
    assert (decoded[: 2 * block] - flat[: 2 * block]).abs().max() < 1e-41


def test_int8_saturates_float16_at_its_limit_instead_of_overflowing() -> None:
    limit = torch.finfo(torch.float16).max
    # bfloat16 scale rounds up to 65536
    flat = torch.tensor([limit, -limit, 1.0, 0.0], dtype=torch.float16)
    decoded = get_codec("int8").decode(get_codec("int8").encode(flat), 4, torch.float16)
    assert decoded[0] == limit and decoded[1] == -limit


def test_fp16_flushes_values_below_its_range_but_bf16_keeps_them() -> None:
    flat = torch.full((8,), 1e-9)
    assert torch.equal(
        get_codec("fp16").decode(get_codec("fp16").encode(flat), 8, flat.dtype), torch.zeros(8)
    )
    assert (
        relative_error(
            flat, get_codec("bf16").decode(get_codec("bf16").encode(flat), 8, flat.dtype)
        )
        < 4e-3
    )


# --- exact byte counts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 31, 32, 33, 1000])
def test_encode_returns_exactly_encoded_size_bytes(
    codec_name: str, dtype: torch.dtype, numel: int
) -> None:
    codec = get_codec(codec_name)
    flat = (sample_tensor("normal", numel=numel) * 3).to(dtype)
    payload = codec.encode(flat)
    assert isinstance(payload, bytes)
    assert len(payload) == codec.encoded_size(numel, dtype)
    assert codec.decode(payload, numel, dtype).shape == (numel,)


@pytest.mark.parametrize(
    ("codec_name", "dtype", "numel", "expected"),
    [
        ("none", torch.float32, 4096, 16384),
        ("none", torch.float64, 10, 80),
        ("fp16", torch.float32, 4096, 8192),
        ("bf16", torch.float64, 4096, 8192),
        ("int8", torch.float32, 4096, 4096 + 2 * 128),  # one 2-byte scale per 32 elements
        ("int8", torch.float32, 33, 33 + 2 * 2),  # a partial tail block has its own scale
        ("int8", torch.float16, 64, 64 + 2 * 2),
        ("int8", torch.int64, 4096, 8 * 4096),  # integers travel raw
        ("fp16", torch.bool, 5, 5),
    ],
)
def test_encoded_size_formula(
    codec_name: str, dtype: torch.dtype, numel: int, expected: int
) -> None:
    assert get_codec(codec_name).encoded_size(numel, dtype) == expected


# --- segments --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("max_segment_bytes", [100, 1000, 4096])
def test_segmentwise_encoding_equals_whole_tensor_encoding(
    codec_name: str, dtype: torch.dtype, max_segment_bytes: int
) -> None:
    codec = get_codec(codec_name)
    # not a multiple of any alignment
    flat = (sample_tensor("student_t2", numel=5003) * 10).to(dtype)
    ranges = segment_ranges(codec, flat.numel(), dtype, max_segment_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == flat.numel()
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(ranges, ranges[1:]))
    assert all(start % codec.alignment(dtype) == 0 for start, _ in ranges)

    payloads = [codec.encode(flat[start:stop]) for start, stop in ranges]
    assert all(len(payload) <= max_segment_bytes for payload in payloads)
    whole = codec.encode(flat)
    assert b"".join(payloads) == whole

    pieces = [
        codec.decode(payload, stop - start, dtype)
        for payload, (start, stop) in zip(payloads, ranges)
    ]
    assert torch.equal(torch.cat(pieces), codec.decode(whole, flat.numel(), dtype))


def test_segment_ranges_edge_cases() -> None:
    int8 = get_codec("int8")
    assert segment_ranges(int8, 0, torch.float32, 1000) == []
    assert segment_ranges(int8, 10, torch.float32, 1000) == [(0, 10)]
    # one aligned unit of int8 is 32 + 2 bytes
    assert segment_ranges(int8, 100, torch.float32, 34) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    with pytest.raises(ValueError, match="below one int8 unit"):
        segment_ranges(int8, 100, torch.float32, 33)


# --- integer pass-through ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_non_float_dtypes_pass_through_as_little_endian_bytes(
    codec_name: str, dtype: torch.dtype
) -> None:
    codec = get_codec(codec_name)
    if dtype == torch.bool:
        flat = torch.tensor([True, False, True, True, False])
    else:
        info = torch.iinfo(dtype)
        flat = torch.tensor(
            [info.min, info.max, 0, 1, 255 % info.max, 12345 % info.max], dtype=dtype
        )
    payload = codec.encode(flat)
    numpy_dtype = flat.numpy().dtype.newbyteorder("<")
    assert payload == np.asarray(flat.numpy(), dtype=numpy_dtype).tobytes()
    decoded = codec.decode(payload, flat.numel(), dtype)
    assert decoded.dtype == dtype and torch.equal(decoded, flat)


def test_token_ids_survive_int8_codec_exactly() -> None:
    tokens = torch.randint(0, 2**40, (4096,), generator=torch.Generator().manual_seed(1))
    codec = get_codec("int8")
    assert torch.equal(codec.decode(codec.encode(tokens), tokens.numel(), torch.int64), tokens)


# --- ownership, input contract -------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_decode_returns_a_tensor_that_owns_its_memory(codec_name: str) -> None:
    codec = get_codec(codec_name)
    flat = sample_tensor("normal", numel=100)
    buffer = bytearray(b"xyz" + codec.encode(flat) + b"tail")
    window = memoryview(buffer)[3 : len(buffer) - 4]
    decoded = codec.decode(window, 100, torch.float32)
    expected = decoded.clone()
    buffer[3 : len(buffer) - 4] = bytes(len(buffer) - 7)  # the transport reuses its buffer
    assert torch.equal(decoded, expected)
    decoded.add_(1.0)  # writable, no read-only buffer underneath


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64], ids=str)
def test_decode_into_fills_a_slice_of_a_larger_tensor_like_decode(
    codec_name: str, dtype: torch.dtype
) -> None:
    codec = get_codec(codec_name)
    flat = (sample_tensor("normal", numel=1000) * 100).to(dtype)
    # about a third of the payload per segment, whatever the codec's compression
    ranges = segment_ranges(codec, flat.numel(), dtype, codec.encoded_size(1000, dtype) // 3)
    assert len(ranges) > 1
    received = torch.full((flat.numel(),), 7, dtype=dtype)
    for start, stop in reversed(ranges):  # segments may be decoded in any order
        codec.decode_into(memoryview(codec.encode(flat[start:stop])), received[start:stop])
    assert torch.equal(received, codec.decode(codec.encode(flat), flat.numel(), dtype))


def test_decode_into_rejects_bad_targets() -> None:
    codec = get_codec("int8")
    payload = codec.encode(torch.ones(64))
    with pytest.raises(ValueError, match="1-D contiguous CPU tensor"):
        codec.decode_into(payload, torch.empty(128)[::2])
    with pytest.raises(CodecError, match="must be 8 bytes, got 68"):  # 32 elements read as int16
        codec.decode_into(payload, torch.empty(4, dtype=torch.int16))


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_encode_leaves_input_untouched_and_accepts_grad_tensors(codec_name: str) -> None:
    flat = sample_tensor("normal", numel=100).requires_grad_()
    before = flat.detach().clone()
    payload = get_codec(codec_name).encode(flat)
    assert torch.equal(flat.detach(), before)
    assert len(payload) == get_codec(codec_name).encoded_size(100, torch.float32)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(2, 3), "reshape"),
        (torch.zeros(10)[::2], "contiguous"),
        (torch.zeros(4, dtype=torch.complex64), "cannot be sent over the wire"),
    ],
)
def test_encode_rejects_tensors_outside_the_contract(tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_codec("none").encode(tensor)


# --- names ---------------------------------------------------------------------------------------------------------


def test_codec_names_and_unknown_codec() -> None:
    assert CODEC_NAMES == ("none", "fp16", "bf16", "int8", "int4", "int2", "int4sr", "int2sr")
    assert all(get_codec(name).name == name for name in CODEC_NAMES)
    with pytest.raises(UnknownCodecError) as caught:
        get_codec("int1")
    assert isinstance(caught.value, CodecError) and isinstance(caught.value, ValueError)
    assert "'int1'" in str(caught.value)
    assert "none, fp16, bf16, int8, int4, int2, int4sr, int2sr" in str(caught.value)
    with pytest.raises(UnknownCodecError):
        get_codec(None)  # type: ignore[arg-type]


def test_wire_dtype_names_round_trip_and_reject_unknown_names() -> None:
    for name in WIRE_DTYPE_NAMES:
        assert wire_dtype_name(dtype_from_name(name)) == name
    assert wire_dtype_name(torch.float32) == "float32" and dtype_from_name("int64") is torch.int64
    for bad in ("float8", "nn", "torch.float32", "", None):
        with pytest.raises(CodecError, match="allowed: float32, float64"):
            dtype_from_name(bad)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="supported dtypes: float32"):
        wire_dtype_name(torch.complex64)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
def test_the_bytes_per_value_table_matches_every_codec(codec_name: str) -> None:
    # the run record describes its compression from this table without importing torch
    encoded = get_codec(codec_name).encoded_size(32 * 1000, torch.float32)
    assert BYTES_PER_VALUE[codec_name] == encoded / (32 * 1000)
