"""Relay: sends a ReplicaRequest over the engine deployment's handle (the request router picks
the replica) and turns the replica's answer into the ingress's HTTP response, streaming SSE
answers event by event. A replica that dies before the client got a byte: the request is resent
(Ray routes it to a live replica); a stream already started ends with an error event."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from forklm.ray_serve.messages import ReplicaRequest, ResponseHead
from forklm.router.proxy import relay_sse
from forklm.server.errors import ApiError

logger = logging.getLogger(__name__)
OnAnswer = Callable[[ResponseHead, bytes], None]
REPLICA_HEADER = "x-forklm-replica"  # which replica answered (its Ray replica id)
# Headers the ingress's own response recomputes.
_RECOMPUTED = frozenset({b"content-length", b"transfer-encoding", b"connection"})


class ReplicaFailed(ApiError):
    """The engine replica failed (its actor died) before the client got a byte: resendable."""

    def __init__(self, message: str):
        super().__init__(502, message)


class Relay:
    """The ingress's side of the engine deployment: one handle, streaming calls to `handle`."""

    def __init__(self, engine: DeploymentHandle, num_replicas: int, max_retries: int = 0):
        self.engine = engine.options(stream=True, method_name="handle")
        self.num_replicas, self.max_retries = num_replicas, max_retries

    async def open(self, request: ReplicaRequest) -> tuple[ResponseHead, AsyncIterator[bytes]]:
        """Send the request; its head, and the body chunks still to come."""
        stream = self.engine.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator), type(stream)  # stream=True
        try:
            head = await stream.__anext__()
        except (RayError, StopAsyncIteration) as e:
            raise ReplicaFailed(f"the engine replica failed before answering ({e!r})") from e
        assert isinstance(head, ResponseHead), type(head)
        return head, _chunks(stream)

    async def answer(self, request: ReplicaRequest, on_answer: OnAnswer | None = None) -> Response:
        """The replica's answer as the ingress's response (SSE streams stay streams);
        on_answer(head, body or a stream's first chunk) sees it first. A replica that fails
        before the client got a byte is retried: Ray has seen its actor die, so it routes the
        request to another replica (at most max_retries more times)."""
        for retry in itertools.count(1):
            try:
                head, first, rest = await self._first_bytes(request)
                break
            except ReplicaFailed as e:
                if retry > self.max_retries:
                    raise
                logger.warning("%s %s: %s; resending it (retry %d of %d)", request.method,
                               request.path, e.message, retry, self.max_retries)
        if on_answer is not None:
            on_answer(head, first)
        headers = {**_passed(head), REPLICA_HEADER: head.replica}
        if rest is None:
            return Response(first, status_code=head.status, headers=headers)
        return StreamingResponse(_in_band_errors(first, rest, head), status_code=head.status,
                                 headers=headers)

    async def _first_bytes(self, request: ReplicaRequest
                           ) -> tuple[ResponseHead, bytes, AsyncIterator[bytes] | None]:
        """The head with the whole body (rest None), or with a stream's first chunk and the
        chunks after it; ReplicaFailed when the replica fails before that."""
        head, chunks = await self.open(request)
        try:
            if head.is_stream:
                return head, await anext(chunks, b""), chunks
            return head, b"".join([chunk async for chunk in chunks]), None
        except RayError as e:
            raise ReplicaFailed(f"replica {head.replica} failed during the request "
                                f"({e!r})") from e

    async def fan_out(self, request: ReplicaRequest) -> list[tuple[ResponseHead, bytes]]:
        """The request to every replica (one per target index; a replica answering twice, as
        while Ray replaces one, is kept once). Replicas that fail are left out.

        One after another: Ray Serve hands a routed replica to the pending call with the same
        internal request id, and the calls one ingress request makes all share that id."""
        unique: dict[str, tuple[ResponseHead, bytes]] = {}
        for target in range(self.num_replicas):
            try:
                head, chunks = await self.open(_targeted(request, target))
                body = b"".join([chunk async for chunk in chunks])
            except (ApiError, RayError) as e:
                logger.warning("fan-out %s to replica #%d failed: %r", request.path, target, e)
                continue
            unique.setdefault(head.replica, (head, body))
        return list(unique.values())


def _targeted(request: ReplicaRequest, target: int) -> ReplicaRequest:
    return ReplicaRequest(request.method, request.path, request.query, request.headers,
                          request.body, target=target)


async def _chunks(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


def _in_band_errors(first: bytes, rest: AsyncIterator[bytes],
                    head: ResponseHead) -> AsyncIterator[bytes]:
    """Relay an SSE stream; once headers are sent, a replica failure travels as an error event."""
    async def failure(e: Exception) -> ApiError:
        return ApiError(502, f"replica {head.replica} failed during the request ({e!r})")

    return relay_sse(first, rest, RayError, failure)


def _passed(head: ResponseHead) -> dict[str, Any]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers
            if k.lower() not in _RECOMPUTED}
