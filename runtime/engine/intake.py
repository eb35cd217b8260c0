"""Request intake: one generate() call (prompts, sampling parameters, samples, logprob options,
rids) validated and tokenized into the engine's Reqs, before anything is submitted."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.config import POOLING_MODES
from forklm.runtime.cpu_threads import release_openmp_threads
from forklm.runtime.engine.detokenizer import IncrementalDetokenizer
from forklm.runtime.engine.engine_request import EngineRequest, LogprobOptions
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.kvcache.namespaces import request_namespace
from forklm.runtime.multimodal.images import Image, ImageLimits, load_images
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.scheduling.request import Req

if TYPE_CHECKING:
    from forklm.runtime.engine.results import GenerateOutput
    from forklm.runtime.lora.adapter import LoraWeights
    from forklm.runtime.lora.registry import LoraRegistry
    from forklm.runtime.multimodal.vision import VisionStage


@dataclass(frozen=True)
class RequestGroup:
    """The Reqs of one generate() call, prompt-major: the n samples of prompt 0, then prompt 1's.
    `reqs[i].index == i`; `single`: one prompt and one sample, answered by one result (not a list).
    """

    reqs: list[Req]
    single: bool
    prompts: list[str | list[int]]  # as given, one per prompt
    num_samples: list[int]  # n of each prompt
    stream: bool = False
    return_text_in_logprobs: bool = True

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def rids(self) -> list[str]:
        return [req.rid for req in self.reqs]

    def to_dict(self, output: GenerateOutput, tokenizer: Any, chunk: bool = False) -> dict[str, Any]:
        """An output of this call in SGLang's shape: logprob text decoded only when the call
        asked for it; a chunk names its result's `index` when the call has several."""
        return output.to_dict(tokenizer if self.return_text_in_logprobs else None,
                              with_index=chunk and len(self.reqs) > 1)

    def prompt_index(self, index: int) -> int:
        """The prompt that result `index` continues."""
        ends = itertools.accumulate(self.num_samples)
        return next(i for i, end in enumerate(ends) if index < end)


# Top logprobs per position: each costs a topk and a Python pair per generated token, so a large
# one multiplies a request's memory (OpenAI's bound, and the HTTP server's: protocol.py).
MAX_TOP_LOGPROBS_NUM = 20
NO_IMAGES = ("this model reads no images (serve a vision-language model: Idefics3, SmolVLM, "
             "Gemma 3, Qwen2.5-VL, Qwen3-VL with their image processor config)")
# The Python API's image bounds (local files allowed); a server decodes its requests' images
# with its own (no files, its URL allow-list) before they get here.
IMAGE_LIMITS = ImageLimits(allow_files=True)
# Priorities and salts are the client's: bounded like every size a request controls.
MAX_PRIORITY = 2**31 - 1
MAX_TEXT_FIELD_CHARS = 1024
# torch.Generator seeds are 64-bit: a seeded request's sample k draws from (seed + k) mod 2**64.
_SEED_MODULUS = 2**64


@dataclass(frozen=True)
class _CheckedLogprobs:
    enabled: bool  # the other two are checked either way, and used only when enabled
    start_len: int  # -1: output logprobs only
    top_num: int


class RequestIntake:
    """Builds RequestGroups for one engine: its tokenizer, vocabulary, context length, KV capacity
    and EOS ids. Seeds: sample k of a request with `seed` draws from seed + k (mod 2**64); an
    unseeded sample gets the next seed of the engine's own sequence (EngineConfig.random_seed).
    A call's requests all exist, or (on a bad argument) none does."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int, kv_capacity: int,
                 eos_token_ids: frozenset[int], random_seed: int,
                 priority_scheduling: str = "ignore", lora: LoraRegistry | None = None,
                 vision: VisionStage | None = None):
        self.tokenizer, self.vocab_size, self.context_len = tokenizer, vocab_size, context_len
        self.lora = lora  # the engine's adapters (None: it serves none)
        self.vision = vision  # a vision-language model's image stage (None: text only)
        # "on": priorities order the queue; "ignore" (off): dropped; "refuse": a 400
        self.priority_scheduling = priority_scheduling
        self.kv_capacity, self.eos_token_ids = kv_capacity, eos_token_ids
        self._random_seed, self._seed_counter = random_seed, itertools.count()
        self.bos_token_id = prompt_bos(tokenizer)

    def build(self, request: EngineRequest, stream: bool = False) -> RequestGroup:
        """Raises InvalidArgumentError naming the bad argument; no Req exists then. `stream`:
        the call's chunks are delivered as they come (a single prompt only)."""
        given, single = _prompt_list(request.prompt, request.input_ids)
        if stream and len(given) != 1:
            raise InvalidArgumentError("stream", stream, "streaming takes a single prompt")
        name = "prompt" if request.prompt is not None else "input_ids"
        # The checks that cost nothing first: a bad field never waits for images to encode.
        params_list = _params_list(request.sampling_params, len(given))
        rids = self._result_rids(request.rid, params_list)
        logprobs = _logprob_options(request.logprobs)
        salt = _check_text("cache_salt", request.cache_salt)
        adapters = self._adapters(request.lora_path, len(given))
        tenant = _check_text("tenant", request.tenant) or ""
        priority = self._priority(request.priority)
        _check_pooling(request.pooling, params_list, stream)
        images = self._images(request.image_data, given, single)
        prompts, mms = [], []
        for p, prompt_images in zip(given, images):
            if prompt_images:
                assert self.vision is not None
                ids, mm = self.vision.prepare(p, prompt_images)
            else:
                ids, mm = self._token_ids(p, name), None
            prompts.append(ids)
            mms.append(mm)
        if any(images):
            # The vision tower ran on this thread (a server's worker, the caller's): the OpenMP
            # team it leaves would make libgomp throttle the engine threads' spin.
            release_openmp_threads()
        for ids, params in zip(prompts, params_list):
            self._check_prompt(ids, params, logprobs)
        reqs: list[Req] = []
        for ids, params, adapter, mm in zip(prompts, params_list, adapters, mms):
            namespace = request_namespace(salt, None if adapter is None else adapter.uid)
            for k in range(params.n):
                req = self._req(ids, params, rids[len(reqs)], k, len(reqs), logprobs)
                req.session_id, req.cache_namespace = request.session_id, namespace
                req.lora, req.mm = adapter, mm
                req.tenant, req.priority = tenant, priority
                req.pooling = request.pooling
                reqs.append(req)
        return RequestGroup(reqs, single and params_list[0].n == 1, given,
                            [p.n for p in params_list], stream,
                            request.logprobs.with_text)

    def _images(self, image_data: Any, prompts: list[Any], single: bool) -> list[list[Image]]:
        """Each prompt's decoded images ([] for none): image_data is one entry for a single
        prompt, or a list of one entry (an image, a list of them, or None) per prompt."""
        if image_data is None:
            return [[] for _ in prompts]
        if self.vision is None:
            raise InvalidArgumentError("image_data", "<given>", NO_IMAGES)
        if single:
            entries = [image_data]
        elif isinstance(image_data, (list, tuple)) and len(image_data) == len(prompts):
            entries = list(image_data)
        else:
            raise InvalidArgumentError("image_data", "<given>", "give one entry (an image, a "
                                       f"list of images or null) per prompt: {len(prompts)}")
        loaded: list[list[Image]] = []
        for i, (prompt, entry) in enumerate(zip(prompts, entries)):
            if entry is None or (isinstance(entry, (list, tuple)) and not entry):
                loaded.append([])
                continue
            if not isinstance(prompt, str):
                raise InvalidArgumentError("image_data", "<given>", "images go with a text "
                                           "prompt (its image placeholders are expanded), not "
                                           "token ids")
            loaded.append(load_images(entry, IMAGE_LIMITS, "image_data" if single
                                      else f"image_data[{i}]"))
        return loaded

    def _adapters(self, lora_path: Any, num_prompts: int) -> list[LoraWeights | None]:
        """Each prompt's adapter: one name (or None) for all, or a list of one per prompt."""
        if lora_path is None:
            return [None] * num_prompts
        names = lora_path if isinstance(lora_path, (list, tuple)) else [lora_path] * num_prompts
        if len(names) != num_prompts:
            raise InvalidArgumentError("lora_path", lora_path, f"{len(names)} adapter names for "
                                       f"{num_prompts} prompts (give one, or one per prompt)")
        if self.lora is None and any(n is not None for n in names):
            raise InvalidArgumentError("lora_path", lora_path, "this engine serves no LoRA "
                                       "adapters (start it with lora_paths or enable_lora)")
        for name in names:
            if name is not None and not isinstance(name, str):
                raise InvalidArgumentError("lora_path", name, "expected an adapter's name")
        assert self.lora is not None or all(n is None for n in names)
        return [None if n is None else self.lora.resolve(n)  # type: ignore[union-attr]
                for n in names]

    def _priority(self, priority: Any) -> int:
        """The checked priority; 0 when unset or when priority scheduling is off (then a given
        one is ignored, as SGLang does, or refused under abort_on_priority_when_disabled)."""
        if priority is None:
            return 0
        value = _check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
        if self.priority_scheduling == "refuse":
            raise InvalidArgumentError("priority", priority, "priority scheduling is off on "
                                       "this engine (enable_priority_scheduling)")
        return value if self.priority_scheduling == "on" else 0

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def _result_rids(self, rid: Any, params_list: list[SamplingParams]) -> list[str]:
        """One rid per result. A list gives each prompt its base rid; a prompt's samples are
        base-0, base-1, ... when n > 1. One str for a batch names the results rid-0, rid-1, ...
        in order. Without rids, each prompt gets a fresh base."""
        if isinstance(rid, str) and rid and len(params_list) > 1:
            return [f"{rid}-{i}" for i in range(sum(p.n for p in params_list))]
        bases = [base or self.new_rid() for base in _rid_list(rid, len(params_list))]
        return [base + (f"-{k}" if p.n > 1 else "")
                for base, p in zip(bases, params_list) for k in range(p.n)]

    def _req(self, ids: list[int], params: SamplingParams, rid: str, sample: int, index: int,
             logprobs: _CheckedLogprobs) -> Req:
        """Sample `sample` of a prompt; a seeded request's sample k draws from seed + k."""
        return Req(
            rid=rid, index=index, origin_input_ids=list(ids), sampling_params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, params.stop or (), params.skip_special_tokens,
                params.spaces_between_special_tokens, params.no_stop_trim,
                params.stop_regex or ()),
            eos_token_ids=self.eos_token_ids, sink=_unset_sink,
            generator=self._generator(None if params.seed is None else params.seed + sample),
            return_logprob=logprobs.enabled,
            logprob_start_len=logprobs.start_len if logprobs.enabled else -1,
            top_logprobs_num=logprobs.top_num if logprobs.enabled else 0,
            max_total_len=self.context_len,
        )

    def _generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            seed = self._random_seed * 1_000_003 + next(self._seed_counter)
        return torch.Generator().manual_seed(seed % _SEED_MODULUS)

    def _token_ids(self, prompt: str | list[int], name: str) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError(name, prompt, "the prompt is empty")
            return encode_prompt(self.tokenizer, prompt, self.bos_token_id)
        ids, vocab = list(prompt), self.vocab_size
        if not ids:
            raise InvalidArgumentError(name, ids, "the prompt is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(name, bad[0], f"token ids must be ints in [0, {vocab})")
        return ids

    def _check_prompt(self, ids: list[int], params: SamplingParams,
                      logprobs: _CheckedLogprobs) -> None:
        if len(ids) >= self.context_len:
            raise InvalidArgumentError("prompt", f"<{len(ids)} tokens>",
                                       f"longer than the model's context_length {self.context_len} "
                                       "(one position must stay free to generate)")
        if len(ids) + 1 > self.kv_capacity:
            raise InvalidArgumentError("prompt", f"<{len(ids)} tokens>", "does not fit the KV "
                                       f"cache (max_total_tokens={self.kv_capacity})")
        for t in params.stop_token_ids or ():
            if not 0 <= t < self.vocab_size:
                raise InvalidArgumentError("stop_token_ids", t, f"must be in [0, {self.vocab_size})")
        for t in params.logit_bias or ():
            if t >= self.vocab_size:
                raise InvalidArgumentError("logit_bias", t,
                                           f"token ids must be in [0, {self.vocab_size})")
        if logprobs.start_len >= len(ids):
            raise InvalidArgumentError("logprob_start_len", logprobs.start_len,
                                       f"must be < the prompt length ({len(ids)} tokens)")


def _check_pooling(pooling: str | None, params_list: list[SamplingParams], stream: bool) -> None:
    """An embedding request pools its prompt once: one sample, nothing generated, no stream."""
    if pooling is None:
        return
    if pooling not in POOLING_MODES:
        raise InvalidArgumentError("pooling", pooling,
                                   f"expected one of {', '.join(POOLING_MODES)}")
    if stream or any(p.max_new_tokens != 0 or p.n != 1 for p in params_list):
        raise InvalidArgumentError("pooling", pooling, "an embedding request generates nothing: "
                                   "max_new_tokens 0, n 1, no stream")


def _unset_sink(out: Any) -> None:
    raise AssertionError("request submitted without a sink")


def _prompt_list(prompt: Any, input_ids: Any) -> tuple[list[Any], bool]:
    """(the prompts, whether a single one was given). `prompt`: a str, a token-id list, or a list
    of either; `input_ids`: a token-id list or a list of them."""
    if (prompt is None) == (input_ids is None):
        raise InvalidArgumentError("prompt", prompt, "give exactly one of prompt or input_ids")
    if prompt is not None:
        if isinstance(prompt, str) or _is_id_list(prompt):
            return [prompt], True
        if _is_list_of(prompt, lambda p: isinstance(p, str) or _is_id_list(p)):
            return list(prompt), False
        raise InvalidArgumentError("prompt", prompt, "expected a str, a token-id list or a list "
                                   "of them")
    if _is_id_list(input_ids):
        return [input_ids], True
    if _is_list_of(input_ids, lambda p: isinstance(p, Sequence) and not isinstance(p, str)):
        return list(input_ids), False
    raise InvalidArgumentError("input_ids", input_ids, "expected a non-empty token-id list or a "
                               "list of them")


def _is_id_list(x: Any) -> bool:
    return _is_list_of(x, lambda t: isinstance(t, int))


def _is_list_of(x: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and bool(x) and all(map(ok, x))


def _params_list(sampling_params: SamplingParams | tuple[SamplingParams, ...],
                 num: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num
    if len(sampling_params) != num:
        raise InvalidArgumentError("sampling_params", f"<list of {len(sampling_params)}>",
                                   f"need one per prompt ({num})")
    return list(sampling_params)


def _rid_list(rid: Any, num: int) -> list[str | None]:
    if rid is None:
        return [None] * num
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) != num or not all(isinstance(r, str) and r for r in rids):
        raise InvalidArgumentError("rid", rid, f"need {num} non-empty string id(s)")
    return rids


def _logprob_options(options: LogprobOptions) -> _CheckedLogprobs:
    top = _check_int("top_logprobs_num", options.top_logprobs_num or 0, 0, MAX_TOP_LOGPROBS_NUM)
    start_len = options.logprob_start_len
    start = -1 if start_len is None else _check_int("logprob_start_len", start_len, -1)
    return _CheckedLogprobs(bool(options.return_logprob), start, top)


def _check_text(name: str, value: Any) -> str | None:
    """A salt or tenant name: None, or a non-empty str of at most MAX_TEXT_FIELD_CHARS."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT_FIELD_CHARS:
        raise InvalidArgumentError(name, value if isinstance(value, str) and len(value) < 80
                                   else f"<{type(value).__name__}>",
                                   f"expected a non-empty string of at most "
                                   f"{MAX_TEXT_FIELD_CHARS} characters")
    return value


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(name, value, f"must be an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidArgumentError(name, value, f"must be an int in [{minimum}, {maximum}]")
    return value


def encode_prompt(tokenizer: Any, text: str, bos_token_id: int | None) -> list[int]:
    """A raw text prompt's ids: it starts with the BOS the tokenizer adds (as SGLang's and
    llama.cpp's servers encode it; Gemma and Llama 2 need it), unless its text already wrote
    one. bos_token_id: prompt_bos(tokenizer)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if bos_token_id is None or ids[:1] == [bos_token_id] else [bos_token_id, *ids]


def prompt_bos(tokenizer: Any) -> int | None:
    """The token id the tokenizer puts before a text when asked for its special tokens (its
    post-processor: a GGUF's add_bos_token, a Hugging Face tokenizer.json's template), or None."""
    try:
        plain = tokenizer.encode("a", add_special_tokens=False)
        special = tokenizer.encode("a", add_special_tokens=True)
    except (TypeError, ValueError):
        return None
    return special[0] if len(special) > len(plain) and special[1:][:len(plain)] == plain else None
