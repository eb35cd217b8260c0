"""Embeddings of a decoder model (Engine.encode, /v1/embeddings) against transformers: the base
model's final-normed last hidden states, pooled the same way and L2-normalized."""

from __future__ import annotations

import base64
import json

import gguf
import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from forklm.runtime.engine.engine import Engine
from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.models.pooling_config import folder_pooling, gguf_pooling
from forklm.runtime.sampling.params import SamplingParams
from tests.conftest import EVAL_QUESTIONS, assert_idle_and_clean
from tests.test_model_loader import TINY, _write_gguf
from tests.tiny_models import build_tiny_model

TOL = 1e-4


@torch.inference_mode()
def hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' reference: the LlamaModel's last_hidden_state (after the final norm)."""
    hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
    pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


def normalized(result: dict) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.tensor(result["embedding"]), dim=0)


def assert_matches_hf(hf_model, tokenizer, results: list[dict], prompts: list[str],
                      pooling: str) -> None:
    for result, prompt in zip(results, prompts, strict=True):
        expected = hf_embedding(hf_model, tokenizer.encode(prompt), pooling)
        assert (normalized(result) - expected).abs().max() < TOL
        assert result["meta_info"]["completion_tokens"] == 0
        assert result["output_ids"] == []


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_single_and_batch_match_transformers(make_engine, hf_model, tokenizer, pooling):
    engine = make_engine()
    single = engine.encode(EVAL_QUESTIONS[0], pooling=pooling)
    assert_matches_hf(hf_model, tokenizer, [single], EVAL_QUESTIONS[:1], pooling)
    batch = engine.encode(EVAL_QUESTIONS[1:5], pooling=pooling)
    assert len(batch) == 4
    assert_matches_hf(hf_model, tokenizer, batch, EVAL_QUESTIONS[1:5], pooling)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_matches_transformers(make_engine, hf_model, tokenizer, pooling):
    engine = make_engine(chunked_prefill_size=16)
    prompt = " ".join(EVAL_QUESTIONS)  # ~80 tokens: 5 or 6 chunks
    assert len(tokenizer.encode(prompt)) > 3 * 16
    assert_matches_hf(hf_model, tokenizer, [engine.encode(prompt, pooling=pooling)], [prompt],
                      pooling)
    assert_idle_and_clean(engine)


def test_cached_prefix_gives_the_same_vector(make_engine, hf_model, tokenizer):
    """Last pooling reuses a cached prefix (only the last position is computed again); mean
    pooling reads every position, so it takes none and is still right."""
    engine = make_engine()
    prompt = EVAL_QUESTIONS[6] + " a cached prefix for the embedding test"
    first = engine.encode(prompt, pooling="last")
    again = engine.encode(prompt, pooling="last")
    assert again["meta_info"]["cached_tokens"] == len(tokenizer.encode(prompt)) - 1
    assert (normalized(first) - normalized(again)).abs().max() < TOL
    assert_matches_hf(hf_model, tokenizer, [again], [prompt], "last")
    mean = engine.encode(prompt, pooling="mean")
    assert mean["meta_info"]["cached_tokens"] == 0
    assert_matches_hf(hf_model, tokenizer, [mean], [prompt], "mean")
    assert_idle_and_clean(engine)


def test_token_ids_and_generation_alongside(make_engine, hf_model, tokenizer):
    engine = make_engine()
    ids = tokenizer.encode(EVAL_QUESTIONS[3])
    by_ids = engine.encode(input_ids=[ids, ids[:5]], pooling="last")
    assert (normalized(by_ids[0]) - hf_embedding(hf_model, ids, "last")).abs().max() < TOL
    assert (normalized(by_ids[1]) - hf_embedding(hf_model, ids[:5], "last")).abs().max() < TOL
    # the default pooling is EngineConfig.pooling ("last"); generation is as before
    again = engine.encode(input_ids=ids)  # its prefix cached: another kernel, same vector
    assert (normalized(again) - normalized(by_ids[0])).abs().max() < TOL
    out = engine.generate(EVAL_QUESTIONS[3], {"max_new_tokens": 3, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 3 and "embedding" not in out
    assert_idle_and_clean(engine)


def test_bad_embedding_requests_are_refused(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidArgumentError, match="pooling"):
        engine.encode("hello", pooling="max")
    with pytest.raises(InvalidArgumentError, match="prompt"):
        engine.encode("")
    streamed = EngineRequest("hello", sampling_params=SamplingParams(max_new_tokens=0),
                             pooling="last")
    with pytest.raises(InvalidArgumentError, match="pooling"):
        engine.prepare(streamed, stream=True)
    generating = EngineRequest("hello", sampling_params=SamplingParams(max_new_tokens=2),
                               pooling="last")
    with pytest.raises(InvalidArgumentError, match="pooling"):
        engine.prepare(generating)
    assert_idle_and_clean(engine)


# -- /v1/embeddings ----------------------------------------------------------------------------
def _post(live_server, **body) -> httpx.Response:
    return httpx.post(f"{live_server.base_url}/v1/embeddings",
                      json={"model": "default", **body}, timeout=60)


@pytest.mark.slow
def test_endpoint_openai_shape_and_base64(live_server, hf_model, tokenizer):
    prompts = EVAL_QUESTIONS[:3]
    reply = _post(live_server, input=prompts)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "default"
    num_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for item, prompt in zip(body["data"], prompts, strict=True):
        assert item["object"] == "embedding"
        vector = torch.tensor(item["embedding"])
        assert abs(float(vector.norm()) - 1) < 1e-5  # normalized here
        assert (vector - hf_embedding(hf_model, tokenizer.encode(prompt), "last")).abs().max() < TOL
    encoded = _post(live_server, input=prompts, encoding_format="base64").json()
    for item, plain in zip(encoded["data"], body["data"], strict=True):
        floats = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert floats.tolist() == pytest.approx(plain["embedding"], abs=1e-6)


@pytest.mark.slow
def test_endpoint_dimensions_and_token_input(live_server, tokenizer):
    ids = tokenizer.encode(EVAL_QUESTIONS[4])
    full = _post(live_server, input=ids).json()["data"][0]["embedding"]
    cut = _post(live_server, input=[ids], dimensions=64).json()["data"][0]["embedding"]
    assert len(cut) == 64
    expected = torch.nn.functional.normalize(torch.tensor(full[:64]), dim=0)
    assert (torch.tensor(cut) - expected).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"input": ""}, {"input": []}, {"input": "hi", "encoding_format": "hex"},
    {"input": "hi", "dimensions": 0}, {"input": "hi", "dimensions": 100_000},
    {"input": [[1, 2], [10**9]]}, {"input": "hi", "pooling": "mean"},
])
def test_endpoint_bad_input_is_400(live_server, body):
    reply = _post(live_server, **body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"]


@pytest.mark.slow
def test_openai_sdk(live_server):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused",
                           max_retries=0)
    created = client.embeddings.create(model="default", input=["a cat", "a dog"])
    plain = _post(live_server, input=["a cat", "a dog"]).json()
    assert [d.index for d in created.data] == [0, 1]
    for got, want in zip(created.data, plain["data"], strict=True):
        assert got.embedding == pytest.approx(want["embedding"], abs=1e-6)
    assert created.usage.prompt_tokens == plain["usage"]["prompt_tokens"]


# -- /v1/score ---------------------------------------------------------------------------------
@torch.inference_mode()
def hf_label_logprobs(hf_model, ids: list[int], labels: list[int]) -> torch.Tensor:
    logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)[labels]


@pytest.mark.slow
@pytest.mark.parametrize("apply_softmax", [False, True])
def test_score_matches_transformers(live_server, hf_model, tokenizer, apply_softmax):
    query, items = "Is the sky blue? Answer:", [" yes", " no, it is green", " maybe"]
    labels = tokenizer.encode(" Yes") + tokenizer.encode(" No")
    reply = httpx.post(f"{live_server.base_url}/v1/score", timeout=60, json={
        "query": query, "items": items, "label_token_ids": labels,
        "apply_softmax": apply_softmax})
    assert reply.status_code == 200, reply.text
    scores = reply.json()["scores"]
    assert len(scores) == len(items) and all(len(s) == len(labels) for s in scores)
    for row, item in zip(scores, items, strict=True):
        logprobs = hf_label_logprobs(hf_model, tokenizer.encode(query + item), labels)
        expected = torch.softmax(logprobs, dim=0) if apply_softmax else logprobs.exp()
        assert row == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.slow
def test_score_token_ids_item_first(live_server, hf_model, tokenizer):
    query, item = tokenizer.encode(" is a color."), tokenizer.encode("Blue")
    labels = [10, 200, 3000]
    reply = httpx.post(f"{live_server.base_url}/v1/score", timeout=60, json={
        "query": query, "items": [item], "label_token_ids": labels, "item_first": True})
    assert reply.status_code == 200, reply.text
    expected = hf_label_logprobs(hf_model, item + query, labels).exp()
    assert reply.json()["scores"][0] == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"query": "q", "items": [], "label_token_ids": [1]},
    {"query": "q", "items": ["a"], "label_token_ids": []},
    {"query": "q", "items": [[1, 2]], "label_token_ids": [1]},
    {"query": "q", "items": ["a"], "label_token_ids": [10**9]},
    {"query": "q", "items": ["a"] * 200, "label_token_ids": [1, 2]},
    {"query": "", "items": [""], "label_token_ids": [0]},  # nothing to score a label after
])
def test_score_bad_input_is_400(live_server, body):
    reply = httpx.post(f"{live_server.base_url}/v1/score", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"]


@pytest.mark.slow
def test_rerank_orders_documents_by_embedding_cosine(live_server):
    query, docs = "Where is the Eiffel tower?", ["Bananas are yellow.", "The Eiffel tower is in "
                                                 "Paris.", "Tax forms are due in April."]
    vectors = [torch.tensor(d["embedding"]) for d in
               _post(live_server, input=[query, *docs]).json()["data"]]
    expected = [float(vectors[0] @ v) for v in vectors[1:]]
    reply = httpx.post(f"{live_server.base_url}/v1/rerank", timeout=60,
                       json={"query": query, "documents": docs}).json()
    ranked = reply["results"]
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -expected[i])
    for r in ranked:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"]["text"] == docs[r["index"]]
    assert reply["usage"]["total_tokens"] > 0
    top = httpx.post(f"{live_server.base_url}/v1/rerank", timeout=60, json={
        "query": query, "documents": docs, "top_n": 1, "return_documents": False}).json()
    assert top["results"] == [{"index": ranked[0]["index"],
                               "relevance_score": ranked[0]["relevance_score"]}]
    for bad in ({"query": query, "documents": []}, {"query": query, "documents": docs,
                                                     "top_n": 0}, {"documents": docs}):
        r = httpx.post(f"{live_server.base_url}/v1/rerank", json=bad, timeout=60)
        assert r.status_code == 400 and "error" in r.json(), r.text


# ---- The pooling a model's own files name (runtime/models/pooling_config.py) ------------------


def write_sentence_transformers_pooling(folder, **flags: bool) -> None:
    """sentence-transformers' layout: modules.json listing a Pooling module in 1_Pooling/."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
              "pooling_mode_lasttoken": False, **flags}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


def test_folder_pooling_is_the_models_own_unless_the_flag_says(tmp_path, tokenizer):
    folder = tmp_path / "tiny"
    model = build_tiny_model("llama3", folder, tokenizer)
    write_sentence_transformers_pooling(folder, pooling_mode_mean_tokens=True)
    prompt = EVAL_QUESTIONS[0]
    with Engine(model_path=str(folder), dtype="float32", max_total_tokens=256) as engine:
        assert engine.model_info.pooling == "mean"
        result = engine.encode(prompt)
    assert (normalized(result) - hf_embedding(model, tokenizer.encode(prompt), "mean")
            ).abs().max() < TOL
    with Engine(model_path=str(folder), dtype="float32", max_total_tokens=256,
                pooling="last") as engine:
        assert engine.model_info.pooling == "last"
        result = engine.encode(prompt)
    assert (normalized(result) - hf_embedding(model, tokenizer.encode(prompt), "last")
            ).abs().max() < TOL


@pytest.mark.parametrize("flags", [{"pooling_mode_max_tokens": True},
                                   {"pooling_mode_mean_tokens": True,
                                    "pooling_mode_cls_token": True}], ids=["max", "mean+cls"])
def test_unsupported_folder_pooling_falls_back_with_a_warning(tmp_path, caplog, flags):
    write_sentence_transformers_pooling(tmp_path, **flags)
    assert folder_pooling(tmp_path) is None
    assert "does not support" in caplog.text and next(iter(flags)) in caplog.text
    assert folder_pooling(tmp_path / "missing") is None  # no modules.json: no preference


def test_gguf_pooling_type_is_the_models_own(tmp_path, monkeypatch):
    class CLSPoolingWriter(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_pooling_type(gguf.PoolingType.CLS)

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "GGUFWriter", CLSPoolingWriter)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 259}, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", config, model.state_dict())
    ids = list(range(3, 40))
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=256) as engine:
        assert engine.model_info.pooling == "cls"
        result = engine.encode(input_ids=ids)
    assert (normalized(result) - hf_embedding(model, ids, "cls")).abs().max() < TOL
    assert gguf_pooling(path, {"llama.pooling_type": 4}, "llama") is None  # rank: unsupported
    assert gguf_pooling(path, {"llama.pooling_type": 0}, "llama") is None  # none: no preference
