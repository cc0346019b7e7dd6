"""The wire names of the codecs, without importing them (configs check a run's codec against these)."""

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4", "int2", "int4sr", "int2sr")
