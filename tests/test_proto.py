"""The committed generated code is exactly what the pinned grpcio-tools makes from proto/swarm.proto."""

from pathlib import Path

import pytest

from swarm.proto import generate

pytestmark = pytest.mark.integration


def test_regeneration_changes_nothing(tmp_path: Path):
    for fresh in generate.generate(tmp_path):
        committed = generate.OUT_DIR / fresh.name
        assert fresh.read_text() == committed.read_text(), (
            f"{committed} is stale: run `make proto` and commit the result"
        )
