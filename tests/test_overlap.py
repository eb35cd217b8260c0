"""The overlap scheduler (runtime/engine/overlap.py) gives the plain loop's tokens in every engine mode,
keeps the KV accounting after every step and leaves nothing allocated; sampling stays on the
logits' device with one host copy per step."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from forklm.runtime.engine.engine import Engine
from forklm.runtime.sampling import sampler
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.sampling.sampler import SamplingRow, sample_on_device
from tests.conftest import assert_idle_and_clean
from tests.tiny_models import build_tiny_model

BASE = {"dtype": "float32", "max_total_tokens": 4096, "debug_check_invariants": True}
# The engine modes the suite tests, each run with the overlap scheduler on and off.
MODES = {
    "default": {},
    "no_radix_cache": {"disable_radix_cache": True},
    "chunked_prefill": {"chunked_prefill_size": 16, "max_prefill_tokens": 48},
    "retraction": {"max_total_tokens": 160, "max_running_requests": 8},
    "fcfs_few_running": {"schedule_policy": "fcfs", "max_running_requests": 3},
    "speculative_ngram": {"speculative_algorithm": "NGRAM"},
    "jump_forward": {"enable_jump_forward": True},
    "deterministic": {"enable_deterministic_inference": True},
    "graph_runner": {"debug_eager_cuda_graph": True, "cuda_graph_max_bs": 4},
}
SYSTEM = "You are a terse assistant. Answer in one line, and never use more words than needed. "
QUESTIONS = ["What is a radix tree?", "Name three colours.", "2 + 2 =", "Say hello.",
             "Count: one two three", "Why is the sky blue?", "apple banana apple banana"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny_llama_overlap")
    build_tiny_model("llama3", folder, tokenizer)
    return str(folder)


def requests(stop_token: int) -> list[tuple[str, dict]]:
    """Prompts sharing a prefix, with lengths that end at different steps, a token stop that ends
    one while the next step is already scheduled, seeded sampling, logprobs and a regex."""
    reqs = [(SYSTEM + q, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
            for q, n in zip(QUESTIONS, [1, 2, 5, 9, 17, 24, 30])]
    reqs.append((SYSTEM + "Stop early.", {"temperature": 0, "max_new_tokens": 20,
                                          "stop_token_ids": [stop_token], "ignore_eos": True}))
    reqs.append((SYSTEM + "Pick freely.", {"temperature": 0.8, "top_k": 40, "seed": 11,
                                           "max_new_tokens": 12, "ignore_eos": True,
                                           "frequency_penalty": 0.5, "min_new_tokens": 4}))
    reqs.append(("A number: ", {"temperature": 0, "max_new_tokens": 12,
                                "regex": "[0-9]{3}-[a-z]{2,4}"}))
    return reqs


def run_workload(engine: Engine, stop_token: int) -> list[tuple]:
    prompts, params = zip(*requests(stop_token))
    outs = engine.generate(list(prompts), sampling_params=list(params), return_logprob=True)
    outs += [engine.generate(SYSTEM + "Stream it.", {"temperature": 0, "max_new_tokens": 6,
                                                     "ignore_eos": True})]
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]


def stop_token_for(model_dir: str) -> int:
    """A token the tiny model emits a few tokens into 'Stop early.' (so that stop fires)."""
    with Engine(model_dir, **BASE, disable_overlap_schedule=True) as engine:
        out = engine.generate(SYSTEM + "Stop early.", {"temperature": 0, "max_new_tokens": 8,
                                                       "ignore_eos": True})
    return out["output_ids"][4]


@pytest.fixture(scope="module")
def stop_token(model_dir):
    return stop_token_for(model_dir)


@pytest.mark.parametrize("mode", list(MODES))
def test_overlap_gives_the_plain_loops_tokens(model_dir, stop_token, mode):
    results = {}
    for overlap in (False, True):
        config = {**BASE, **MODES[mode], "disable_overlap_schedule": not overlap}
        with Engine(model_dir, **config) as engine:
            results[overlap] = run_workload(engine, stop_token)
            assert_idle_and_clean(engine)
    assert results[True] == results[False]
    stopped = results[True][7]
    assert stopped[1]["type"] == "stop" and len(stopped[0]) == 5, stopped  # the token stop fired


def test_abort_while_the_next_step_is_in_flight(model_dir):
    """Aborts land between pipelined steps: the aborted request ends with its reason, the others
    finish as alone, and no slot or row is left."""
    with Engine(model_dir, **BASE) as engine:
        alone = engine.generate(SYSTEM + "Keep going.", {"temperature": 0, "max_new_tokens": 40,
                                                         "ignore_eos": True})
        got: dict[str, dict] = {}

        def run(rid: str) -> None:
            got[rid] = engine.generate(SYSTEM + "Keep going.", rid=rid, sampling_params={
                "temperature": 0, "max_new_tokens": 40, "ignore_eos": True})

        threads = [threading.Thread(target=run, args=(rid,)) for rid in ("a", "b")]
        for t in threads:
            t.start()
        chunks = engine.generate(SYSTEM + "Abort me.", rid="c", stream=True, sampling_params={
            "temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
        for i, _ in enumerate(chunks):
            if i == 3:
                engine.abort("c")
        for t in threads:
            t.join()
        assert got["a"]["output_ids"] == got["b"]["output_ids"] == alone["output_ids"]
        assert_idle_and_clean(engine)


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that read device memory from the host (each is a sync on a
    GPU): the CPU run shows where a GPU run would stall."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class Row:
    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.sampling_params = params
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.origin_input_ids, self.output_ids = [1, 2, 3], [4, 5]
        self.min_tokens_stop_ids, self.top_logprobs_num = [0], 0


@pytest.mark.parametrize("params", [
    {"temperature": 0},
    {"temperature": 0.7, "top_k": 20, "seed": 3},
    {"temperature": 0.9, "top_p": 0.8, "seed": 5},
    {"temperature": 0.9, "min_p": 0.05, "seed": 4, "frequency_penalty": 0.3,
     "repetition_penalty": 1.2, "min_new_tokens": 5, "logit_bias": {"7": 2.0}},
], ids=["greedy", "top_k", "top_p", "min_p_penalties"])
def test_sampling_reads_the_device_once(params, monkeypatch):
    """As on a GPU (where a host read is a sync): nothing is read before the samples are
    wanted, then one copy brings ids and logprobs; the same tokens as the CPU's own path."""
    params = dict(params)
    seed = params.pop("seed", None)
    logits = torch.randn(4, 300)

    def rows() -> list[SamplingRow]:
        return [Row(SamplingParams(**params), seed) for _ in range(4)]

    on_cpu = sample_on_device(logits.clone(), rows()).to_host()
    monkeypatch.setattr(sampler, "_host_reads_are_free", lambda t: False)
    with HostReads() as counter:
        samples = sample_on_device(logits.clone(), rows())
    assert counter.reads == []
    with HostReads() as counter:
        host = samples.to_host()
    assert counter.reads == ["tolist"]
    assert host.token_ids == on_cpu.token_ids
    assert host.logprobs == pytest.approx(on_cpu.logprobs)
