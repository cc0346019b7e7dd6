"""The 4-bit and 2-bit codecs (swarm/compression/lowbit.py): every value lands on its block's grid (the nearest
level, or a neighbour with the right odds under stochastic rounding), round trips at every width and odd size,
and the grid each block takes. The contracts shared by every codec (exact sizes, segments, NaN/Inf, garbage)
are tested for these codecs too, in test_compression.py and test_codec_errors.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import relative_error, sample_tensor

from swarm.compression import get_codec

NEAREST = ("int4", "int2")
STOCHASTIC = ("int4sr", "int2sr")
LOW_BIT = NEAREST + STOCHASTIC
BITS = {"int4": 4, "int2": 2, "int4sr": 4, "int2sr": 2}
BLOCK = 32


def grids(name: str, payload: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the payload's block scales back: per element (numel,), its block's grid step and the offset of its
    levels (levels are (k + offset) * step for integers k), as documented in the codec's module docstring."""
    bits = BITS[name]
    half = 2 ** (bits - 1)
    row = 2 + BLOCK * bits // 8
    steps, offsets = [], []
    for start in range(0, numel, BLOCK):
        count = min(BLOCK, numel - start)
        at = start // BLOCK * row
        raw = int.from_bytes(payload[at : at + 2], "little")
        midrise = bool(raw & 0x8000)
        scale = float(torch.tensor([raw & 0x7FFF], dtype=torch.int16).view(torch.bfloat16))
        steps.append(torch.full((count,), scale / (half - 0.5 if midrise else half - 1)))
        offsets.append(torch.full((count,), 0.5 if midrise else 0.0))
    return torch.cat(steps).double(), torch.cat(offsets).double()


@pytest.mark.parametrize("name", NEAREST)
@pytest.mark.parametrize("distribution", ["normal", "student_t2", "lognormal"])
def test_round_to_nearest_puts_each_value_on_the_nearest_level_of_its_blocks_grid(
    name: str, distribution: str
) -> None:
    codec = get_codec(name)
    flat = sample_tensor(distribution, numel=BLOCK * 500 + 7)  # a short tail block too
    payload = codec.encode(flat)
    decoded = codec.decode(payload, flat.numel(), flat.dtype).double()
    step, offset = grids(name, payload, flat.numel())
    half = 2 ** (BITS[name] - 1)
    # the decoded value is a level of the block's grid: (k + offset) * step, k an integer in the grid's range
    k = decoded / step - offset
    assert torch.allclose(k, k.round(), atol=1e-4)
    low = torch.where(offset > 0, -half, -(half - 1))
    high = torch.full_like(low, half - 1)
    assert bool(((k.round() >= low) & (k.round() <= high)).all())
    # and the nearest one: the value, clamped to the outermost levels, is within half a step of it
    x = flat.double()
    inside = x.clamp((low + offset) * step, (high + offset) * step)
    assert bool(((inside - decoded).abs() <= step / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("name", LOW_BIT)
def test_a_blocks_largest_value_is_never_clipped_on_the_centred_grid_and_zero_stays_zero(
    name: str,
) -> None:
    codec = get_codec(name)
    # one outlier per block among small values: heavy-tailed blocks take the centred grid, which holds 0 exactly
    blocks = sample_tensor("normal", numel=BLOCK * 200).view(-1, BLOCK) * 0.01  # (nb, b)
    blocks[:, 5] = 50.0
    blocks[:, 9] = 0.0
    flat = blocks.reshape(-1)
    payload = codec.encode(flat)
    decoded = codec.decode(payload, flat.numel(), flat.dtype).view(-1, BLOCK)
    _, offset = grids(name, payload, flat.numel())
    assert bool((offset == 0).all()), "blocks with an outlier take the centred grid"
    # the outlier keeps its value to the bfloat16 rounding of the scale (never clipped)
    assert torch.allclose(decoded[:, 5], torch.full((200,), 50.0), rtol=2**-7)
    assert bool((decoded[:, 9] == 0).all())


@pytest.mark.parametrize("name", NEAREST)
def test_bell_shaped_blocks_take_the_midrise_grid_and_use_every_code(name: str) -> None:
    codec = get_codec(name)
    flat = sample_tensor("normal", numel=BLOCK * 400)
    payload = codec.encode(flat)
    _, offset = grids(name, payload, flat.numel())
    # a normal block's max |x| is below 4 rms unless it is very unlucky
    assert float((offset > 0).double().mean()) > 0.95
    decoded = codec.decode(payload, flat.numel(), flat.dtype)
    levels_used = torch.unique(decoded.view(-1, BLOCK)[0]).numel()
    assert levels_used <= 2 ** BITS[name]


@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_not(name: str) -> None:
    """Many blocks of values near 0.3 with one 1.0 each: round-to-nearest maps 0.3 to the same level every time
    (a bias of up to half a step); stochastic rounding's mean over the ~125k values is 0.3 within 5 standard
    errors (each value lands on one of two levels one step apart, so its standard deviation is <= step / 2)."""
    generator = torch.Generator().manual_seed(1)
    blocks = 0.3 + 1e-3 * torch.randn(4096, BLOCK, generator=generator)  # (nb, b)
    blocks[:, 0] = 1.0
    flat = blocks.reshape(-1)
    payload = get_codec(name).encode(flat)
    decoded = get_codec(name).decode(payload, flat.numel(), flat.dtype).view(-1, BLOCK)[:, 1:]
    step, _ = grids(name, payload, flat.numel())
    count = decoded.numel()
    tolerance = 5 * float(step.max()) / 2 / math.sqrt(count)
    bias = float(decoded.double().mean() - blocks[:, 1:].double().mean())
    assert abs(bias) < tolerance, (bias, tolerance)
    nearest = name.removesuffix("sr")
    rounded = get_codec(nearest).decode(get_codec(nearest).encode(flat), flat.numel(), flat.dtype)
    nearest_bias = float(rounded.view(-1, BLOCK)[:, 1:].double().mean() - 0.3)
    assert abs(nearest_bias) > 10 * tolerance, nearest_bias  # the test could tell the two apart


@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_rounding_is_a_pure_function_of_the_tensor(name: str) -> None:
    codec = get_codec(name)
    flat = sample_tensor("student_t2", numel=BLOCK * 100 + 3)
    assert codec.encode(flat) == codec.encode(flat.clone())
    # and moves every value by less than one step of its grid
    payload = codec.encode(flat)
    step, offset = grids(name, payload, flat.numel())
    decoded = codec.decode(payload, flat.numel(), flat.dtype).double()
    # values within the outermost level (the 2-bit midrise grid clips beyond 1.5 rms of the block)
    outermost = step * (2 ** (BITS[name] - 1) - 1 + offset)
    inside = flat.double().abs() <= outermost
    assert bool(((decoded - flat.double()).abs()[inside] < step[inside] * (1 + 1e-5)).all())


@pytest.mark.parametrize("name", LOW_BIT)
@pytest.mark.parametrize(
    "shape", [(1,), (2,), (31,), (33,), (63,), (3, 5, 7), (8, 16, 33), (4097,)]
)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_round_trips_at_every_width_size_and_dtype(
    name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    codec = get_codec(name)
    tensor = sample_tensor("normal", numel=math.prod(shape), seed=len(shape)).view(shape).to(dtype)
    flat = tensor.reshape(-1)
    payload = codec.encode(flat)
    assert len(payload) == codec.encoded_size(flat.numel(), dtype)
    decoded = codec.decode(payload, flat.numel(), dtype).view(shape)
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    if flat.numel() >= BLOCK * 8:  # enough values for the relative error to mean something
        bound = {"int4": 0.11, "int2": 0.4, "int4sr": 0.15, "int2sr": 0.5}[name]
        assert relative_error(flat.float(), decoded.reshape(-1).float()) < bound
    # a single value is its block's largest: the outermost level, which is the bfloat16 scale
    if flat.numel() == 1:
        assert torch.allclose(decoded.float(), tensor.float(), rtol=2**-7)


@pytest.mark.parametrize("name", LOW_BIT)
def test_tiny_and_huge_blocks_keep_their_relative_precision(name: str) -> None:
    codec = get_codec(name)
    magnitudes = [1e-35, 1e-30, 1e-12, 1.0, 1e20, 1e37]
    flat = torch.cat(
        [sample_tensor("normal", numel=BLOCK * 64, seed=i) * m for i, m in enumerate(magnitudes)]
    )
    decoded = codec.decode(codec.encode(flat), flat.numel(), flat.dtype)
    bound = {"int4": 0.11, "int2": 0.4, "int4sr": 0.15, "int2sr": 0.5}[name]
    for index, magnitude in enumerate(magnitudes):
        piece = slice(index * BLOCK * 64, (index + 1) * BLOCK * 64)
        assert relative_error(flat[piece], decoded[piece]) < bound, magnitude


@pytest.mark.parametrize("name", LOW_BIT)
def test_bytes_per_value_are_what_the_name_promises(name: str) -> None:
    codec = get_codec(name)
    bits = BITS[name]
    # a full block: a 2-byte scale plus bits / 8 bytes per value
    assert codec.encoded_size(BLOCK * 1000, torch.float32) == 1000 * (2 + BLOCK * bits // 8)
    # a tail of 3 values: its own scale and ceil(3 * bits / 8) bytes
    assert codec.encoded_size(BLOCK + 3, torch.float32) == (2 + BLOCK * bits // 8) + 2 + -(
        -3 * bits // 8
    )
