"""RuntimeEndpoint: a program backend over a forklm server's HTTP API."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import httpx

from forklm.frontend_dsl.backends.base import (
    Backend,
    BackendError,
    ChatTurn,
    GenResult,
    OnText,
)
from forklm.frontend_dsl.backends.engine_backend import EngineBackend
from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod
from forklm.frontend_dsl.defaults import RunDefaults
from forklm.frontend_dsl.executor import Executor
from forklm.frontend_dsl.ir import ProgramLimits
from forklm.frontend_dsl.state import ProgramState
from forklm.runtime.engine.engine_request import EngineRequest, LogprobOptions
from forklm.runtime.engine.results import GenerateOutput
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from forklm.frontend_dsl.ir import Graph

_CLIENT_ERRORS = (400, 404, 413, 422)
_LIMIT_NAMES = frozenset(f.name for f in dataclasses.fields(ProgramLimits))


class RuntimeEndpoint(Backend):
    """`RuntimeEndpoint(base_url, api_key=None, timeout=600.0, lora_path=None)`: run programs on a
    forklm server (through its LoRA adapter `lora_path`, if given).

    gen, select, roles and prefix caching are EngineBackend's own logic run against the server's
    `/generate`, with the server model's tokenizer and chat template (fetched once from
    `/v1/programs/tokenizer`), so select scores on exactly the tokens the in-process backend
    would and chat turns render as the server's template does. `run_batch` of a program that
    traces sends the whole batch to `/v1/programs/run` in one request. Server errors are raised
    as InvalidArgumentError (4xx) or BackendError with the server's message."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 lora_path: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._lock = threading.Lock()
        self._background: set[threading.Thread] = set()  # see in_background
        # Async programs' calls: one client per event loop (a client belongs to its loop).
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                                       httpx.AsyncClient] = (
            weakref.WeakKeyDictionary())
        self.model_info = self.call("GET", "/get_model_info")
        self.tokenizer = _load_tokenizer(self.call("GET", "/v1/programs/tokenizer")["files"])
        self.lora_path = lora_path
        self._local = EngineBackend(_RemoteEngine(self, self.tokenizer), lora_path=lora_path)

    # -- Backend -------------------------------------------------------------------------------
    def generate(self, prompt: str, sampling_params: SamplingParams,
                 logprob_options: LogprobOptions,
                 on_text: OnText | None = None) -> GenResult:
        return self._local.generate(prompt, sampling_params, logprob_options, on_text=on_text)

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        return self._local.select(prompt, choices, choices_method)

    async def agenerate_turn(self, prompt: str, turn: ChatTurn, sampling_params: SamplingParams,
                             logprob_options: LogprobOptions,
                             on_text: OnText | None = None) -> GenResult:
        if on_text is not None:  # streamed: the blocking client, on a thread
            return await super().agenerate_turn(prompt, turn, sampling_params, logprob_options,
                                                on_text)
        return await self._local.agenerate_turn(prompt, turn, sampling_params, logprob_options)

    async def aselect(self, prompt: str, choices: list[str],
                      choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        return await self._local.aselect(prompt, choices, choices_method)

    def with_session(self) -> tuple[Backend, Callable[[], None]] | None:
        """A copy whose calls carry one server session (/open_session at the first gen,
        session_params on every /generate, /close_session when the program ends)."""
        inner = self._local.with_session()
        if inner is None:
            return None
        local, close = inner
        view = copy.copy(self)
        view._local = local  # type: ignore[assignment]
        return view, close

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        return self._local.role_prefix_suffix(role, history)

    def default_system_prompt(self) -> str | None:
        return self._local.default_system_prompt()

    def cache_prefix(self, prompt: str) -> None:
        self._local.cache_prefix(prompt)

    def abort(self, rid: str) -> None:
        self._local.abort(rid)

    def run_program_batch(self, graph: Graph, batch_arguments: list[dict[str, Any]],
                          defaults: dict[str, Any]) -> list[ProgramState] | None:
        """One POST /v1/programs/run for the whole batch; None (run item by item) when the
        arguments or defaults are not JSON values or the graph is over the server's program
        limits (those bound one request; item-by-item calls are the client's own loop), or when
        the programs run through an adapter (the server's program runner takes none)."""
        if self.lora_path is not None:
            return None
        defaults = {k: v for k, v in defaults.items() if v is not None}
        body = {"program": json.loads(graph.to_json()), "arguments": list(batch_arguments),
                "sampling_params": defaults}
        try:
            content = json.dumps(body, allow_nan=False)
        except (TypeError, ValueError):
            return None
        try:
            reply = self.call("POST", "/v1/programs/run", content=content,
                              headers={"content-type": "application/json"})
        except InvalidArgumentError as e:
            if e.name in _LIMIT_NAMES:
                return None
            raise
        return [self._finished_state(r, defaults) for r in reply["results"]]

    # -- HTTP ----------------------------------------------------------------------------------
    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; the decoded JSON reply, or the server's error raised."""
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {e!r}") from e
        return _reply(response, path)

    async def call_async(self, method: str, path: str, **kwargs: Any) -> Any:
        """`call` on the running event loop (one pooled async client per loop)."""
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            client = self._async_clients[loop] = httpx.AsyncClient(
                base_url=self.base_url, headers=self.client.headers, timeout=self.client.timeout,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {e!r}") from e
        return _reply(response, path)

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON payloads of an SSE reply until `data: [DONE]`; leaving early closes the
        connection, which makes the server abort the request."""
        try:
            with self.client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    _raise_server_error(response.status_code, _error_of(response.read().decode()),
                                        path)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    payload = json.loads(data)
                    if "error" in payload:
                        err = payload["error"]
                        _raise_server_error(int(err.get("code") or 500), err, path)
                    yield payload
        except httpx.HTTPError as e:
            raise BackendError(f"POST {self.base_url}{path} failed: {e!r}") from e

    def flush_cache(self) -> bool:
        """POST /flush_cache: False when the server refuses (requests are in flight)."""
        try:
            self.call("POST", "/flush_cache")
        except InvalidArgumentError as e:
            if "in flight" in str(e):
                return False
            raise
        return True

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.call("GET", "/get_server_info")
        return info

    def in_background(self, fn: Callable[[], Any]) -> None:
        """Run fn on a thread of its own; close() waits for it before closing the client."""
        def run() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    self._background.discard(thread)

        thread = threading.Thread(target=run, name="forklm-endpoint-background", daemon=True)
        with self._lock:  # started before close() can see it
            self._background.add(thread)
            thread.start()

    def close(self) -> None:
        """Wait (up to the client's timeout) for the calls still running in the background (the
        closes of programs' sessions), then close the HTTP client."""
        with self._lock:
            pending = list(self._background)
        for thread in pending:
            thread.join(timeout=self.client.timeout.read or 60.0)
        self.client.close()

    def _finished_state(self, result: dict[str, Any], defaults: dict[str, Any]) -> ProgramState:
        """A done state holding the server's text, messages, variables and their meta (or the
        item's error, raised when the state is read); appending to it runs on this endpoint."""
        ex = Executor(self, RunDefaults.from_kwargs(defaults)[0])
        if "error" in result:
            ex.error = _error_from(result["error"], "/v1/programs/run")
            return ProgramState(ex)
        ex.load_finished(result["text"], result["messages"], result["variables"],
                         result["meta_info"]["variables"])
        return ProgramState(ex)


class _RemoteEngine:
    """A SessionEngineClient served by a forklm server over HTTP."""

    def __init__(self, endpoint: RuntimeEndpoint, tokenizer: Any):
        self.endpoint, self.tokenizer = endpoint, tokenizer

    def generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        return _outputs(self.endpoint.call("POST", "/generate", json=request.to_json()))

    def stream_outputs(self, request: EngineRequest) -> Iterator[GenerateOutput]:
        """The server streams cumulative text and ids (SGLang's shape) and each event's own
        logprobs; the chunks here are increments, as the engine's are."""
        events = self.endpoint.stream("/generate", {**request.to_json(), "stream": True})
        text, num_ids = "", 0
        for event in events:
            ids = event["output_ids"]
            yield GenerateOutput.from_json(
                {**event, "text": event["text"][len(text):], "output_ids": ids[num_ids:]})
            text, num_ids = event["text"], len(ids)

    async def async_generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        """generate_outputs over the caller's event loop (async programs)."""
        return _outputs(await self.endpoint.call_async("POST", "/generate",
                                                       json=request.to_json()))

    async def async_stream_outputs(self, request: EngineRequest
                                   ) -> AsyncIterator[GenerateOutput]:
        raise NotImplementedError("RuntimeEndpoint streams only through its blocking API")

    # Sessions (the server's /open_session and /close_session; see SessionClient).
    def open_session(self, session_id: str | None = None, wait: bool = True) -> str:
        """POST /open_session (it always waits for the server's answer)."""
        sid: str = self.endpoint.call("POST", "/open_session", json=_open_body(session_id))
        return sid

    async def async_open_session(self, session_id: str | None = None) -> str:
        sid: str = await self.endpoint.call_async("POST", "/open_session",
                                                  json=_open_body(session_id))
        return sid

    def close_session(self, session_id: str, wait: bool = True) -> bool:
        """With wait=False the request is sent from a thread of its own (a program's close
        must not wait, nor be cancelled with the program's task); RuntimeEndpoint.close()
        waits for those."""
        def close() -> bool:
            try:
                self.endpoint.call("POST", "/close_session", json={"session_id": session_id})
            except (InvalidArgumentError, BackendError):  # unknown by now (idled out), or down
                return False
            return True

        if wait:
            return close()
        self.endpoint.in_background(close)
        return True

    def abort(self, rid: str) -> None:
        self.endpoint.call("POST", "/abort_request", json={"rid": rid})


def _open_body(session_id: str | None) -> dict[str, Any]:
    return {} if session_id is None else {"session_id": session_id}


def _outputs(reply: Any) -> list[GenerateOutput]:
    """A /generate reply (one result, or a list for a batch or n > 1) as GenerateOutputs."""
    results = reply if isinstance(reply, list) else [reply]
    return [GenerateOutput.from_json(r, index=i) for i, r in enumerate(results)]


def _load_tokenizer(files: dict[str, str]) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            (Path(tmp) / Path(name).name).write_text(text, encoding="utf-8")
        return AutoTokenizer.from_pretrained(tmp)


def _reply(response: httpx.Response, path: str) -> Any:
    if response.status_code >= 400:
        _raise_server_error(response.status_code, _error_of(response.text), path)
    return response.json()


def _error_of(text: str) -> dict[str, Any]:
    try:
        error = json.loads(text)["error"]
        return error if isinstance(error, dict) else {"message": str(error)}
    except (ValueError, KeyError, TypeError):
        return {"message": text[:500]}


def _raise_server_error(status: int, error: dict[str, Any], path: str) -> NoReturn:
    if status in _CLIENT_ERRORS:
        error = {**error, "type": "invalid_request_error"}
    raise _error_from(error, f"{path} (HTTP {status})")


def _error_from(error: dict[str, Any], where: str) -> Exception:
    """The server's error as the exception the in-process backend would raise, same message."""
    message = str(error.get("message") or "unknown server error")
    if error.get("type") == "invalid_request_error":
        exc = InvalidArgumentError(error.get("param") or "request", None, message)
        exc.args = (message,)  # the server's message already names the argument and value
        return exc
    return BackendError(f"{where}: {message}")
