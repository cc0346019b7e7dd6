"""A swarm of `swarm peer --device cpu --dtype bf16` processes trains through the CLI (the loss falls) with the
wire in the run's float32 codec, and `swarm status --json` shows each replica's device, dtype and memory."""

from __future__ import annotations

import pytest
from conftest import SOLO_PEER_FLAGS, TEST_TRAINER

from swarm.coordinator.localswarm import finished

pytestmark = pytest.mark.swarm

# seq_len 32: bf16 matmuls run ~13x slower than fp32 on a CPU without AVX512-BF16/AMX (this one: AVX2), so
# the test keeps its tokens few
PEER_FLAGS = [
    *SOLO_PEER_FLAGS,
    "--seq-len",
    "32",
    "--no-rebalance",
    "--device",
    "cpu",
    "--dtype",
    "bf16",
]


def test_bf16_peers_train_through_the_cli_and_status_shows_their_device(module_swarm):
    swarm, run_id = module_swarm, "bf16"
    procs = [swarm.peer(f"bf16-s{k}", k, *PEER_FLAGS, run_id=run_id, wait=False) for k in (0, 1)]
    for p in procs:
        swarm.wait_ready(p)
    trainer = swarm.trainer(
        "bf16-trainer",
        run_id=run_id,
        **{**TEST_TRAINER, "eval_batches": 2},
        steps=20,
        max_batches_ahead=1,
    )
    summary = finished(trainer, timeout_s=600)
    # judged on the trained weights' validation loss, as tests/test_hf_swarm.py does (one spike of the noisy
    # training-loss mean at lr 3e-3 can put it above the first step's)
    assert summary.val_loss < 0.8 * summary.initial_loss, summary.describe()
    # a separate process that imports torch: over 60 s at a load average of 47 on 2 cores, seen here
    doc = swarm.status(run_id, timeout_s=300)
    replicas = [r for stage in doc["stages"] for r in stage["replicas"]]
    assert len(replicas) == 2
    assert all((r["device"], r["dtype"]) == ("cpu", "bf16") for r in replicas), replicas
    assert all(0 < r["memory_bytes"] < r["device_memory_bytes"] for r in replicas), replicas
    swarm.group.stop_all([p.name for p in procs], timeout_s=40)
    for p in procs:
        assert p.popen.returncode == 0, p.log_path.read_text()[-2000:]
