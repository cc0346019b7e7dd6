"""The wire names of the codecs, without importing them (configs check a run's codec against these)."""

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4", "int2", "int4sr", "int2sr")

# Wire bytes per floating value in whole 32-value blocks (a scale per block included), for describing a run
# without importing the codecs; tests/test_compression.py checks it against each codec's encoded_size.
BYTES_PER_VALUE: dict[str, float] = {
    "none": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 34 / 32,
    "int4": 18 / 32,
    "int2": 10 / 32,
    "int4sr": 18 / 32,
    "int2sr": 10 / 32,
}
