"""Server side: start a grpc.aio server for a StagePeer servicer and map typed errors to statuses."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from swarm.errors import ERROR_METADATA_KEY, SwarmError, wire_name
from swarm.proto import swarm_pb2 as pb
from swarm.proto import swarm_pb2_grpc as pb_grpc
from swarm.transport.channel import GRPC_OPTIONS

logger = logging.getLogger(__name__)


async def start_server(
    servicer: pb_grpc.StagePeerServicer, *, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Start serving on ``host:port`` (port 0 picks a free one); return the server and the bound port."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_StagePeerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(
            f"cannot listen on {host}:{port}: the port is taken or the address is not local; "
            f"pick another --port or --host"
        )
    await server.start()
    return server, bound


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
            await _drain(request_iterator)
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


async def _drain(
    request_iterator, *, timeout_s: float = 2.0, idle_s: float = 0.25, max_bytes: int = 64 << 20
) -> None:
    """Read (and drop) what the caller is still sending before answering with an error.

    grpc.aio clients whose write fails because the server already ended the call report
    INTERNAL "Internal error from Core" instead of the server's status (grpc/grpc#36066); letting the
    caller finish its writes first makes it see our status and sentence. Bounded in time and bytes:
    a caller streaming more than that gets the error regardless. Stops once nothing came for ``idle_s``:
    a caller that sent its whole request and now waits for the reply (its commit frame comes only after
    one) writes nothing more, and must not wait out ``timeout_s`` for its error.
    """
    if not hasattr(request_iterator, "__aiter__"):
        return  # unary request: nothing left to read

    async def consume() -> None:
        seen = 0
        frames = request_iterator.__aiter__()
        while seen <= max_bytes:
            try:
                frame = await asyncio.wait_for(frames.__anext__(), idle_s)
            except (StopAsyncIteration, asyncio.TimeoutError):
                return
            seen += frame.ByteSize()

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except Exception:
        pass  # best effort: the error goes out either way


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
