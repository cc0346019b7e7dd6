"""Server side: start a grpc.aio server for a StagePeer servicer and map typed errors to statuses."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from swarm.deadline import timeout
from swarm.errors import ERROR_METADATA_KEY, StreamTimeout, SwarmError, wire_name
from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc
from swarm.transport.channel import GRPC_OPTIONS
from swarm.transport.tensors import MalformedFrame
from swarm.transport.wire import add_stage_servicer

logger = logging.getLogger(__name__)

# A server's receive windows: gRPC grows each stream's flow-control window to the bandwidth-delay product it
# measures (its BDP probe), which on loopback reached tens of MiB per stream: memory a caller makes the peer hold
# before the request-memory budget sees a byte (bench/results/peer_flood.md: 3.6 GiB over rest with a 128 MiB
# budget). A fixed window per stream bounds it. The default; a peer's is LimitsConfig.stream_window_bytes.
STREAM_WINDOW_BYTES = 1 << 20


def server_options(window_bytes: int = STREAM_WINDOW_BYTES) -> list[tuple[str, object]]:
    """gRPC server options with each stream's receive window fixed at ``window_bytes``."""
    return [
        *GRPC_OPTIONS,
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", window_bytes),
    ]


# Refused requests drained at once, per process (see drain_request): each holds up to a receive window while it is
# read, and a flood of refused calls must not buy memory past the budgets; past it, a refused call ends at once.
MAX_DRAINS = 8

# At most one log line per this many seconds about garbage frames; the lines in between are counted.
GARBAGE_LOG_EVERY_S = 10.0


class _RateLimitedLog:
    """One warning line now and then for an event a caller can repeat at will (garbage frames): a flood of
    them must not flood the log, nor hide that it happened."""

    def __init__(self, every_s: float, clock=time.monotonic):
        self.every_s, self._clock = every_s, clock
        self._last: float | None = None
        self.suppressed = 0

    def warning(self, message: str, *args) -> None:
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            self.suppressed += 1
            return
        if self.suppressed:
            message += f" ({self.suppressed} more like it in the last {now - self._last:.0f}s)"
        self._last, self.suppressed = now, 0
        logger.warning(message, *args)


_garbage_log = _RateLimitedLog(GARBAGE_LOG_EVERY_S)


async def start_server(
    servicer: pb_grpc.StagePeerServicer,
    *,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    window_bytes: int = STREAM_WINDOW_BYTES,
    max_calls: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start serving on ``host:port`` (port 0 picks a free one); return the server and the bound port. With
    ``credentials`` (see :mod:`swarm.transport.security`) it serves TLS only; ``interceptors`` see every call
    before its handler (e.g. :class:`swarm.transport.callers.CallerCheck`). ``window_bytes``: each call's receive
    window; ``max_calls``: calls open at once, past which gRPC itself refuses new ones (RESOURCE_EXHAUSTED) before
    they reach a handler (None: no limit)."""
    server = grpc.aio.server(
        options=server_options(window_bytes),
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=max_calls,
    )
    add_stage_servicer(servicer, server)
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(
            f"cannot listen on {host}:{port}: the port is taken or the address is not local; "
            f"pick another --port or --host"
        )
    await server.start()
    return server, bound


class DeadlineFrames:
    """A call's request frames, read under deadlines: each frame within ``idle_s`` of asking for it, and the
    whole request within ``total_s`` of the first read, so a silent or trickling caller cannot hold a stream
    (and what was allocated for it) forever. A late frame raises :class:`StreamTimeout` (DEADLINE_EXCEEDED).
    :meth:`expect_within` replaces both deadlines for a frame that comes only after the reply (the commit)."""

    def __init__(self, frames, *, idle_s: float, total_s: float, clock=time.monotonic):
        self._frames = frames.__aiter__()
        self._idle_s, self._total_s, self._clock = idle_s, total_s, clock
        self._deadline: float | None = None  # set at the first read
        self._next_within_s: float | None = None

    def __aiter__(self):
        return self

    def expect_within(self, timeout_s: float) -> None:
        """The next frames may take up to ``timeout_s`` each, whatever the request's deadlines were."""
        self._next_within_s = timeout_s

    async def __anext__(self):
        now = self._clock()
        if self._deadline is None:
            self._deadline = now + self._total_s
        if self._next_within_s is not None:
            timeout_s, why = self._next_within_s, f"within {self._next_within_s:g}s"
        else:
            timeout_s = min(self._idle_s, self._deadline - now)
            why = (
                f"within --read-idle-s={self._idle_s:g}s of the last"
                if timeout_s == self._idle_s
                else f"in all within --read-total-s={self._total_s:g}s"
            )
        try:
            # a timeout scope, not wait_for: no task per frame
            async with timeout(max(timeout_s, 0.0)):
                return await self._frames.__anext__()
        except TimeoutError:
            raise StreamTimeout(
                f"the request's frames did not arrive {why}; the call is cut (send a request without "
                f"pauses, on a link fast enough for it)"
            ) from None


def stream_handler(fn: Callable[..., AsyncIterator[pb.Frame]]):
    """Wrap a streaming handler so that a :class:`SwarmError` ends the call with its status, message and class
    name (see :func:`abort_with`), and any other exception with INTERNAL (logged with its traceback, never
    shown raw to the caller)."""

    @functools.wraps(fn)
    async def wrapper(self, request_iterator, context: grpc.aio.ServicerContext):
        started, outcome = time.perf_counter(), "ok"
        try:
            async for frame in fn(self, request_iterator, context):
                yield frame
        except SwarmError as e:
            outcome = type(e).__name__
            if isinstance(e, MalformedFrame):
                _garbage_log.warning("%s from %s: %s", fn.__name__, context.peer(), e)
            else:
                await drain_request(request_iterator)
            await abort_with(context, e)
        except grpc.aio.AbortError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"  # the caller went away (its deadline, a broken stream)
            raise
        except Exception as e:  # a bug in our handler: log it, answer with a sentence, keep serving
            outcome = "internal"
            logger.exception("internal error while handling %s", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in peer ({type(e).__name__}: {e}); see the peer's log",
            )
        finally:
            _observe(self, fn.__name__, time.perf_counter() - started, outcome)

    return wrapper


def _observe(servicer, method: str, seconds: float, outcome: str) -> None:
    """Report a finished call to the servicer's ``observer`` (metrics), if it has one."""
    observer = getattr(servicer, "observer", None)
    if observer is not None:
        try:
            observer(method, seconds, outcome)
        except Exception:  # metrics must never fail a call
            logger.exception("recording the metrics of a %s call failed", method)


async def drain_request(
    request_iterator,
    *,
    timeout_s: float = 2.0,
    idle_s: float = 0.25,
    max_bytes: int = 64 << 20,
    counted: bool = True,
) -> None:
    """Read (and drop) what the caller is still sending before answering with an error.

    grpc.aio clients whose write fails because the server already ended the call report
    INTERNAL "Internal error from Core" instead of the server's status (grpc/grpc#36066); letting the
    caller finish its writes first makes it see our status and sentence. Bounded in time and bytes:
    a caller streaming more than that gets the error regardless. Stops once nothing came for ``idle_s``:
    a caller that sent its whole request and now waits for the reply (its commit frame comes only after
    one) writes nothing more, and must not wait out ``timeout_s`` for its error. At most :data:`MAX_DRAINS`
    ``counted`` calls drain at once: past that (a flood of refused requests) the error goes out at once,
    undrained. A refusal before any handler (an unauthenticated caller: 1 s, 1 MiB at most) is not counted, so a
    caller without a valid token always reads UNAUTHENTICATED; every draining call is an open call all the same,
    bounded by the server's open calls (``--max-open-calls``).
    """
    global _draining
    if not hasattr(request_iterator, "__aiter__") or (counted and _draining >= MAX_DRAINS):
        return  # unary request: nothing left to read; or too many drains already

    async def consume() -> None:
        seen = 0
        frames = request_iterator.__aiter__()
        while seen <= max_bytes:
            try:
                frame = await asyncio.wait_for(frames.__anext__(), idle_s)
            except (StopAsyncIteration, asyncio.TimeoutError):
                return
            seen += frame.ByteSize()

    _draining += counted
    try:
        await asyncio.wait_for(consume(), timeout_s)
    except Exception:
        pass  # best effort: the error goes out either way
    finally:
        _draining -= counted


_draining = 0  # calls drain_request is reading now (one event loop per process: no lock)


def unary_handler(fn: Callable[..., Awaitable]):
    """Same as :func:`stream_handler` for unary calls."""

    @functools.wraps(fn)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        started, outcome = time.perf_counter(), "ok"
        try:
            return await fn(self, request, context)
        except SwarmError as e:
            outcome = type(e).__name__
            await abort_with(context, e)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            _observe(self, fn.__name__, time.perf_counter() - started, outcome)

    return wrapper


async def abort_with(context: grpc.aio.ServicerContext, error: SwarmError) -> None:
    """End the call with ``error``'s code and message, naming its class in the trailing metadata so the
    client rebuilds the same type (:func:`swarm.errors.error_from_status`) whatever the code is shared with."""
    name = wire_name(error)
    metadata = ((ERROR_METADATA_KEY, name),) if name else ()
    await context.abort(error.code, str(error), trailing_metadata=metadata)
