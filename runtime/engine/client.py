"""EngineClient: the engine as its clients call it (program backends, the server's program runner).
`Engine` satisfies it in this process; a wrapper that tracks requests, or one that forwards them to
a server over HTTP, satisfies it too."""

from __future__ import annotations

from typing import Any, Protocol


class EngineClient(Protocol):
    """Generation in SGLang's shapes: `generate` returns a result dict (a list of them for a batch
    or n > 1), or with stream=True an iterator of chunk dicts whose `text` and `output_ids` are
    increments (each chunk of a call with several results names its `index`); the last chunk of
    each result carries its finish_reason. `abort(rid)` finishes a request with finish_reason
    abort (an unknown or finished rid is a no-op). `tokenizer` is the model's (Hugging Face API)."""

    tokenizer: Any

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 *, return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None, stream: bool = False,
                 rid: Any = None) -> Any: ...

    def abort(self, rid: str) -> None: ...
