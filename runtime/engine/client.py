"""EngineClient: the engine as forklm's own callers use it (program backends, the server's program
runner): an EngineRequest in, GenerateOutputs out. `Engine` satisfies it in this process; a
wrapper that tracks requests, or one that forwards them to a server over HTTP, satisfies it too."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from forklm.runtime.engine.engine_request import EngineRequest
    from forklm.runtime.engine.results import GenerateOutput


class EngineClient(Protocol):
    """`generate_outputs` returns every result of a request (prompt-major: the n samples of
    prompt 0, then prompt 1's), each `finished`. `stream_outputs` (a single prompt) yields chunks
    whose `text` and `output_ids` are increments; `index` names a chunk's result and each
    result's last chunk carries its finish_reason. An aborted request finishes with
    finish_reason abort. `abort(rid)` of an unknown or finished rid is a no-op. `tokenizer` is
    the model's (Hugging Face API). The async twins run on the caller's event loop; a client
    that cannot stream asynchronously raises NotImplementedError there."""

    tokenizer: Any

    def generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]: ...

    def stream_outputs(self, request: EngineRequest) -> Iterator[GenerateOutput]: ...

    async def async_generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]: ...

    async def async_stream_outputs(self, request: EngineRequest
                                   ) -> AsyncIterator[GenerateOutput]: ...

    def abort(self, rid: str) -> None: ...


class SessionEngineClient(EngineClient, Protocol):
    """An EngineClient with sessions (SGLang's open_session/close_session): requests that name
    an open session (EngineRequest.session_id) leave what they end with pinned in the radix
    cache until it closes. Opening raises InvalidArgumentError when the engine has no radix
    cache; a request naming a session the engine no longer knows raises InvalidArgumentError
    naming session_params."""

    def open_session(self, session_id: str | None = None, wait: bool = True) -> str: ...

    async def async_open_session(self, session_id: str | None = None) -> str: ...

    def close_session(self, session_id: str, wait: bool = True) -> bool: ...
