"""Codecs refuse what they cannot carry faithfully: non-finite values, overflow, and every malformed payload
raises a CodecError saying what was wrong (never another exception, never a silent wrong tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import relative_error, sample_tensor

from swarm.compression import (
    CODEC_NAMES,
    CodecError,
    CodecOverflowError,
    NonFiniteTensorError,
    get_codec,
)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# --- NaN / Inf -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "bad_value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"]
)
def test_encode_rejects_non_finite_values(
    codec_name: str, dtype: torch.dtype, bad_value: float
) -> None:
    flat = sample_tensor("normal", numel=100).to(dtype)
    flat[77] = bad_value
    with pytest.raises(NonFiniteTensorError, match="first at element 77"):
        get_codec(codec_name).encode(flat)


@pytest.mark.parametrize("codec_name", [n for n in CODEC_NAMES if n != "none"])
def test_codecs_that_check_while_encoding_refuse_non_finite_values_even_when_told_they_are_finite(
    codec_name: str,
) -> None:
    # known_finite only lets codec none skip a pass of its own; every other codec's check is part of its encoding
    flat = sample_tensor("normal", numel=100)
    flat[77] = float("nan")
    with pytest.raises(NonFiniteTensorError, match="first at element 77"):
        get_codec(codec_name).encode_view(flat, known_finite=True)


@pytest.mark.parametrize("codec_name", ["none", "fp16", "bf16", "int8", "int4", "int2"])
def test_known_finite_changes_no_byte_of_a_finite_tensor(codec_name: str) -> None:
    codec = get_codec(codec_name)
    flat = sample_tensor("student_t2", numel=1000)
    assert bytes(codec.encode_view(flat, known_finite=True)) == codec.encode(flat)


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("position", [0, 50_001, 100_002])
def test_encode_finds_a_single_nan_anywhere_in_a_large_tensor(
    codec_name: str, position: int
) -> None:
    flat = sample_tensor("normal", numel=100_003)
    flat[position] = float("nan")
    with pytest.raises(
        NonFiniteTensorError, match=f"1 non-finite values .* first at element {position}:"
    ):
        get_codec(codec_name).encode(flat)


def test_opposite_infinities_are_caught_and_huge_finite_values_are_not() -> None:
    flat = torch.zeros(1000)
    flat[10], flat[900] = float("inf"), float("-inf")  # their sum is NaN, not Inf
    with pytest.raises(NonFiniteTensorError, match="2 non-finite values"):
        get_codec("none").encode(flat)
    huge = torch.full((1000,), 3e38)  # finite values whose float32 sum overflows
    assert torch.equal(
        get_codec("none").decode(get_codec("none").encode(huge), 1000, torch.float32), huge
    )
    decoded = get_codec("int8").decode(get_codec("int8").encode(huge), 1000, torch.float32)
    assert relative_error(huge, decoded) < 1e-2


def test_fp16_overflow_is_reported_as_overflow_not_as_nan() -> None:
    flat = torch.tensor([1.0, 70000.0, -2.0])
    with pytest.raises(CodecOverflowError, match="7e\\+04.*bf16 or int8"):
        get_codec("fp16").encode(flat)
    assert get_codec("bf16").decode(get_codec("bf16").encode(flat), 3, flat.dtype)[1] == 70144.0


def test_int8_overflow_of_float64_beyond_scale_range() -> None:
    flat = torch.tensor([1e300, 1.0], dtype=torch.float64)
    with pytest.raises(CodecOverflowError, match="scale the tensor down"):
        get_codec("int8").encode(flat)


# +Inf scale, 0 * Inf is NaN too
@pytest.mark.parametrize(
    ("codec_name", "dtype", "payload"),
    [
        ("none", torch.float32, np.array([1.0, np.nan], dtype="<f4").tobytes()),
        ("none", torch.float16, np.array([1.0, -np.inf], dtype="<f2").tobytes()),
        ("fp16", torch.float32, np.array([np.nan, 1.0], dtype="<f2").tobytes()),
        ("fp16", torch.float32, bytes.fromhex("007c0000")),  # +Inf, 0 in float16
        ("bf16", torch.float32, bytes.fromhex("c07f0000")),  # NaN, 0 in bfloat16
        ("int8", torch.float32, bytes.fromhex("c07f") + bytes([1, 2])),  # NaN scale
        (
            "int8",
            torch.float32,
            bytes.fromhex("807f") + bytes([1, 0]),
        ),
        ("int8", torch.bfloat16, bytes.fromhex("807f") + bytes([0, 1])),  # +Inf scale into bfloat16
    ],
)
def test_decode_rejects_payloads_that_decode_to_non_finite(
    codec_name: str, dtype: torch.dtype, payload: bytes
) -> None:
    with pytest.raises(
        NonFiniteTensorError, match="payload is corrupt or the sender shipped NaN/Inf"
    ):
        get_codec(codec_name).decode(payload, 2, dtype)


# --- bad payloads --------------------------------------------------------------------------------------------------


def test_truncated_payload_message_names_sizes_and_cause() -> None:
    codec = get_codec("int8")
    payload = codec.encode(sample_tensor("normal", numel=4096))
    with pytest.raises(CodecError) as caught:
        codec.decode(payload[:4000], 4096, torch.float32)
    assert str(caught.value) == (
        "int8 payload for 4096 float32 elements must be 4352 bytes, got 4000: "
        "the stream was truncated or the sender used another codec"
    )


@pytest.mark.parametrize("codec_name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_wrong_length_payloads_raise_codec_error(codec_name: str, dtype: torch.dtype) -> None:
    codec = get_codec(codec_name)
    payload = codec.encode((sample_tensor("normal", numel=100) * 5).to(dtype))
    for bad in (payload[:-1], payload + b"\0", b"", payload[: len(payload) // 2]):
        with pytest.raises(CodecError, match="must be"):
            codec.decode(bad, 100, dtype)


def test_payload_from_another_codec_is_rejected() -> None:
    flat = sample_tensor("normal", numel=1024)
    with pytest.raises(CodecError, match="sender used another codec"):
        get_codec("int8").decode(get_codec("fp16").encode(flat), 1024, torch.float32)


def test_int8_negative_scale_is_garbage() -> None:
    payload = bytes.fromhex("80bf") + bytes([1, 2])  # scale -1.0
    with pytest.raises(CodecError, match="negative block scale"):
        get_codec("int8").decode(payload, 2, torch.float32)


def test_bool_payload_with_other_bytes_is_garbage() -> None:
    with pytest.raises(CodecError, match="other than 0 and 1"):
        get_codec("none").decode(bytes([0, 1, 7]), 3, torch.bool)


def test_random_garbage_never_escapes_as_anything_but_codec_error() -> None:
    generator = np.random.default_rng(0)
    for codec_name in CODEC_NAMES:
        codec = get_codec(codec_name)
        for _ in range(50):
            numel = int(generator.integers(1, 200))
            size = codec.encoded_size(numel, torch.float32)
            garbage = generator.integers(0, 256, size=size, dtype=np.uint8).tobytes()
            try:
                decoded = codec.decode(garbage, numel, torch.float32)
            except CodecError:
                continue
            assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("numel", [-1, 1.5, "3"])
def test_bad_element_counts_raise_codec_error(numel: object) -> None:
    with pytest.raises(CodecError, match="non-negative int"):
        get_codec("none").decode(b"", numel, torch.float32)  # type: ignore[arg-type]
