"""The HTTP endpoint a peer or a trainer serves its Prometheus metrics on (``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import start_wsgi_server


class MetricsEndpoint:
    """A registry of its own (several peers may share a process), with the process' memory and CPU in it,
    served at ``/metrics`` from a thread once :meth:`serve` is called."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self._server = None

    def serve(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: a free port); returns the port."""
        try:
            self._server, _ = start_wsgi_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {host}:{port} ({e.strerror or e}); pick another --metrics-port"
            ) from None
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
