"""``swarm monitor``: a live dashboard of a run, served as one web page (no build step, no CDN).

The process joins the DHT as a client, reads the run's status (the document of ``swarm status --json``, see
:mod:`swarm.coordinator.status`) every ``period_s`` and keeps a short history of each stage's serving
throughput and step. A small HTTP server (stdlib, its own thread) serves:

- ``/``: the page (``dashboard.html`` next to this module), which polls ``/status.json`` and redraws;
- ``/status.json``: ``{"status": <status document> | null, "error": str | null, "history": [{"time",
  "throughput": [per stage], "step": [per stage], "trainers": {id: [loss, tokens/s]}}], "moves": [{"time",
  "peer_id", "from", "to"}]}``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from swarm.coordinator.status import read_status, status_document
from swarm.discovery.config import DHTConfig

logger = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("dashboard.html")
HISTORY = 600  # samples kept per stage (10 minutes at the default period)
MOVES = 50  # stage changes kept


class MonitorState:
    """What the page shows, updated by the poller and read by the server's threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._status: dict[str, Any] | None = None
        self._error: str | None = "reading the DHT..."
        self._history: collections.deque = collections.deque(maxlen=HISTORY)
        self._moves: collections.deque = collections.deque(maxlen=MOVES)
        self._stage_of: dict[str, int] = {}

    def update(self, document: dict[str, Any]) -> None:
        with self._lock:
            self._status, self._error = document, None
            stages = document["stages"]
            self._history.append(
                {
                    "time": document["time"],
                    "throughput": [stage["throughput"] for stage in stages],
                    "step": [
                        max((r["step"] for r in stage["replicas"]), default=0) for stage in stages
                    ],
                    # each trainer's loss and tokens/s at this read
                    "trainers": {
                        t["trainer_id"]: [t["loss"], t["tokens_per_s"]]
                        for t in document.get("trainers", [])
                    },
                }
            )
            for stage in stages:
                for replica in stage["replicas"]:
                    before = self._stage_of.get(replica["peer_id"])
                    if before is not None and before != stage["stage"]:
                        self._moves.append(
                            {
                                "time": document["time"],
                                "peer_id": replica["peer_id"],
                                "from": before,
                                "to": stage["stage"],
                            }
                        )
                    self._stage_of[replica["peer_id"]] = stage["stage"]

    def failed(self, message: str) -> None:
        with self._lock:
            self._error = message

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "status": self._status,
                "error": self._error,
                "history": list(self._history),
                "moves": list(self._moves),
            }


def _handler(state: MonitorState, page: bytes):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path in ("/", "/index.html"):
                self._send(page, "text/html; charset=utf-8")
            elif self.path == "/status.json":
                self._send(json.dumps(state.snapshot()).encode(), "application/json")
            else:
                self.send_error(HTTPStatus.NOT_FOUND, "the dashboard serves / and /status.json")

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the stdlib's signature)
            logger.debug("dashboard: " + format, *args)

    return Handler


async def run_monitor(
    run_id: str, dht_config: DHTConfig, *, host: str, port: int, period_s: float
) -> int:
    """Serve the dashboard of ``run_id`` until cancelled (Ctrl-C)."""
    from swarm.discovery.dht import RunDirectory, start_dht

    if not period_s > 0:
        raise ValueError(f"--period-s must be > 0 seconds, got {period_s}")
    state = MonitorState()
    try:
        server = ThreadingHTTPServer((host, port), _handler(state, PAGE.read_bytes()))
    except OSError as e:
        raise OSError(
            f"cannot serve the dashboard on {host}:{port} ({e.strerror or e}); pick another --port"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
    thread.start()
    dht = None
    try:
        dht = await asyncio.to_thread(start_dht, dht_config, client_mode=True)
        directory = RunDirectory(dht, run_id, run_owner=dht_config.run_owner)
        print(
            f"swarm monitor: dashboard of run '{run_id}' at http://{host}:{server.server_port}/",
            flush=True,
        )
        while True:
            try:
                found = await read_status(directory)
                if found is None:
                    state.failed(
                        f"no run '{run_id}' is published in this DHT yet (check --run-id and --initial-peers)"
                    )
                else:
                    run = found[0]
                    document = status_document(run_id, *found, owner=directory.owner)
                    document["run"] = {
                        "codec": run.codec,
                        "target_batch_size": run.target_batch_size,
                        "lr": run.lr,
                        "model": {
                            "d_model": run.model.d_model,
                            "n_layers": run.model.n_layers,
                            "seq_len": run.model.seq_len,
                        },
                    }
                    state.update(document)
            except Exception as e:  # keep serving the last status; say what failed
                logger.warning("reading the run's status failed: %s", e)
                state.failed(f"reading the DHT failed: {e}")
            await asyncio.sleep(period_s)  # the polling period asked for
    finally:
        server.shutdown()
        server.server_close()
        if dht is not None:
            dht.shutdown()
