"""LoRA adapters (runtime/lora/) against transformers + PEFT in fp32 on a tiny random Llama: greedy
tokens of mixed batches (three adapters and the base model in one call), the radix cache keyed by
adapter, the per-batch adapter limit, memory-bounded residency, run-time load/unload, and bad
adapters refused with the reason."""

from __future__ import annotations

import json
import pathlib

import peft
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.lora.adapter import parse_lora_paths
from tests.conftest import assert_idle_and_clean
from tests.tiny_models import build_tiny_model

PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "def fibonacci(n):"]
NEW_TOKENS = 12
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig fields: attention only at rank 8 with alpha scaling; the MLP at rank 16
# without (alpha = r); everything at rank 8 with rsLoRA's alpha / sqrt(r).
ADAPTERS = {
    "attn8": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "mlp16": dict(r=16, lora_alpha=16, target_modules=MLP),
    "all8rs": dict(r=8, lora_alpha=32, use_rslora=True, target_modules=ATTENTION + MLP),
}


def make_adapter(base: torch.nn.Module, folder: pathlib.Path, seed: int, **config) -> peft.PeftModel:
    """A PEFT adapter on `base` with random A and B (PEFT starts B at zero: no update), saved."""
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tokenizer):
    """The base model's folder, each adapter's folder, and transformers + PEFT's greedy tokens
    for every (adapter or None, prompt)."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    base = build_tiny_model("llama3", base_dir, tokenizer)
    expected: dict[tuple[str | None, str], list[int]] = {}

    def greedy(model) -> None:
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                     attention_mask=torch.ones_like(ids), pad_token_id=0)
            yield_ids = out[0, ids.shape[1]:].tolist()
            expected[(name, prompt)] = yield_ids

    name = None
    greedy(base)
    folders = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        base = build_tiny_model("llama3", root / "scratch", tokenizer)  # a fresh copy each time
        folders[name] = root / name
        greedy(make_adapter(base, folders[name], seed, **config))
    return base_dir, folders, expected


def lora_engine(make_engine, lora_setup, **config) -> Engine:
    base_dir, folders, _ = lora_setup
    config.setdefault("lora_paths", tuple(f"{n}={f}" for n, f in folders.items()))
    return make_engine(model_path=str(base_dir), **config)


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}


def _run(engine: Engine, pairs: list[tuple[str | None, str]]) -> list[dict]:
    return engine.generate([p for _, p in pairs], GREEDY,
                           lora_path=[a for a, _ in pairs])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode-layers", "eager-layers"])
def test_a_mixed_batch_matches_peft_token_for_token(make_engine, lora_setup, fused):
    _, _, expected = lora_setup
    engine = lora_engine(make_engine, lora_setup, disable_fused_layers=not fused)
    pairs = [(a, p) for p in PROMPTS for a in [None, *ADAPTERS]]
    results = _run(engine, pairs)
    for (adapter, prompt), result in zip(pairs, results):
        assert result["output_ids"] == expected[(adapter, prompt)], (adapter, prompt)
    # Every adapter changes what the model says (else the check above proves nothing).
    for adapter in ADAPTERS:
        assert any(expected[(adapter, p)] != expected[(None, p)] for p in PROMPTS), adapter
    assert_idle_and_clean(engine)


def test_the_radix_cache_never_shares_kv_between_adapters(make_engine, lora_setup):
    _, _, expected = lora_setup
    engine = lora_engine(make_engine, lora_setup)
    engine.flush_cache()
    prompt = PROMPTS[1]
    first = _run(engine, [("attn8", prompt)])[0]
    assert first["meta_info"]["cached_tokens"] == 0
    again = _run(engine, [("attn8", prompt)])[0]
    assert again["meta_info"]["cached_tokens"] > 0  # its own adapter's prefix is reused
    assert again["output_ids"] == expected[("attn8", prompt)]
    for other in (None, "mlp16"):
        result = _run(engine, [(other, prompt)])[0]
        assert result["meta_info"]["cached_tokens"] == 0, other
        assert result["output_ids"] == expected[(other, prompt)]


def test_a_batch_takes_at_most_max_loras_per_batch_adapters(make_engine, lora_setup):
    _, _, expected = lora_setup
    engine = lora_engine(make_engine, lora_setup, max_loras_per_batch=1)
    seen: list[set[int]] = []
    runner = engine.parts.runner
    forward = runner.forward

    def counting(batch, input_ids=None):
        seen.append({r.lora.uid for r in batch.reqs if r.lora is not None})
        return forward(batch, input_ids)

    runner.forward = counting
    try:
        pairs = [(a, p) for p in PROMPTS[:2] for a in [None, *ADAPTERS]]
        results = _run(engine, pairs)
    finally:
        del runner.forward
    assert [r["output_ids"] for r in results] == [expected[pair] for pair in pairs]
    assert seen and max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3
    assert_idle_and_clean(engine)


def test_resident_adapters_are_bounded_and_evicted_least_recently_used(make_engine, lora_setup):
    _, _, expected = lora_setup
    engine = lora_engine(make_engine, lora_setup, max_loaded_loras=1)
    registry = engine.parts.lora
    assert registry is not None and registry.resident_names() == ["all8rs"]
    for adapter in ("attn8", "mlp16", "attn8"):
        assert _run(engine, [(adapter, PROMPTS[0])])[0]["output_ids"] == \
            expected[(adapter, PROMPTS[0])]
        assert registry.resident_names() == [adapter]  # read again from its folder when named
    assert sorted(engine.lora_adapters()) == sorted(ADAPTERS)


def test_adapters_load_and_unload_at_run_time(make_engine, lora_setup):
    _, folders, expected = lora_setup
    engine = lora_engine(make_engine, lora_setup, lora_paths=(), enable_lora=True)
    for name in list(engine.lora_adapters()):  # the engine may be shared with an earlier test
        engine.unload_lora_adapter(name)
    with pytest.raises(InvalidArgumentError, match="lora_path.*no adapter of that name"):
        _run(engine, [("attn8", PROMPTS[0])])
    engine.load_lora_adapter("attn8", str(folders["attn8"]))
    assert _run(engine, [("attn8", PROMPTS[0])])[0]["output_ids"] == \
        expected[("attn8", PROMPTS[0])]
    with pytest.raises(InvalidArgumentError, match="already loaded"):
        engine.load_lora_adapter("attn8", str(folders["mlp16"]))
    engine.unload_lora_adapter("attn8")
    with pytest.raises(InvalidArgumentError, match="lora_name"):
        engine.unload_lora_adapter("attn8")
    # The same name, other weights: nothing computed through the old ones is reused.
    engine.load_lora_adapter("attn8", str(folders["mlp16"]))
    result = _run(engine, [("attn8", PROMPTS[0])])[0]
    assert result["output_ids"] == expected[("mlp16", PROMPTS[0])]
    assert result["meta_info"]["cached_tokens"] == 0
    engine.unload_lora_adapter("attn8")
    assert_idle_and_clean(engine)


def test_an_engine_without_lora_refuses_adapters(make_engine, lora_setup):
    base_dir, folders, _ = lora_setup
    engine = make_engine(model_path=str(base_dir))
    with pytest.raises(InvalidArgumentError, match="lora_path.*serves no LoRA"):
        engine.generate(PROMPTS[0], GREEDY, lora_path="attn8")
    with pytest.raises(InvalidArgumentError, match="enable_lora"):
        engine.load_lora_adapter("attn8", str(folders["attn8"]))


def _write_adapter(folder: pathlib.Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors:
        safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


QK = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("config, tensors, why", [
    ({"r": 8, "lora_alpha": 8, "use_dora": True},
     {f"{QK}.lora_A.weight": torch.zeros(8, 64), f"{QK}.lora_B.weight": torch.zeros(64, 8)},
     "DoRA"),
    ({"r": 8, "lora_alpha": 8}, {f"{QK}.lora_A.weight": torch.zeros(8, 32),
                                 f"{QK}.lora_B.weight": torch.zeros(64, 8)},
     "trained for another base model"),
    ({"r": 8, "lora_alpha": 8}, {f"{QK}.lora_A.weight": torch.zeros(8, 64)}, "without its pair"),
    ({"r": 8, "lora_alpha": 8},
     {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
      "base_model.model.lm_head.lora_B.weight": torch.zeros(100, 8)}, "cannot update"),
    ({"r": 8, "lora_alpha": 8}, {}, "safetensors only"),
    ({"r": 0}, {f"{QK}.lora_A.weight": torch.zeros(8, 64)}, "r=0"),
    ({"r": 8, "lora_alpha": 8, "peft_type": "IA3"}, {}, "IA3"),
])
def test_bad_adapters_are_refused_naming_the_problem(make_engine, lora_setup, tmp_path, config,
                                                     tensors, why):
    engine = lora_engine(make_engine, lora_setup, lora_paths=(), enable_lora=True)
    folder = _write_adapter(tmp_path / "bad", config, tensors)
    with pytest.raises(InvalidArgumentError, match=why):
        engine.load_lora_adapter("bad", folder)
    assert "bad" not in engine.lora_adapters()


def test_bad_lora_path_arguments(make_engine, lora_setup):
    engine = lora_engine(make_engine, lora_setup)
    with pytest.raises(InvalidArgumentError, match="2 adapter names for 3 prompts"):
        engine.generate(PROMPTS, GREEDY, lora_path=["attn8", None])
    with pytest.raises(InvalidArgumentError, match="expected an adapter's name"):
        engine.generate(PROMPTS[0], GREEDY, lora_path=[7])
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        engine.load_lora_adapter("nowhere", "/nonexistent/adapter")
    assert parse_lora_paths(["a=/x", "/y"]) == {"a": "/x", "/y": "/y"}
    with pytest.raises(InvalidArgumentError, match="given twice"):
        parse_lora_paths(["a=/x", "a=/y"])
    with pytest.raises(InvalidArgumentError, match="tp_size"):
        Engine(model_path="unused", lora_paths=("a=/x",), tp_size=2)


@pytest.fixture(scope="module")
def lora_server(make_engine, lora_setup):
    from tests.conftest import serve_in_thread

    server = serve_in_thread(lora_engine(make_engine, lora_setup, enable_lora=True))
    yield server
    server.stop()


def test_http_generate_and_openai_models_name_adapters(lora_server, lora_setup):
    import httpx
    import openai

    _, _, expected = lora_setup
    url = lora_server.base_url
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    one = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": greedy,
                                              "lora_path": "attn8"}, timeout=60).json()
    assert one["output_ids"] == expected[("attn8", PROMPTS[0])]
    batch = httpx.post(f"{url}/generate", json={
        "text": PROMPTS, "sampling_params": greedy, "lora_path": ["mlp16", None, "all8rs"]},
        timeout=60).json()
    assert [r["output_ids"] for r in batch] == [
        expected[("mlp16", PROMPTS[0])], expected[(None, PROMPTS[1])],
        expected[("all8rs", PROMPTS[2])]]
    models = httpx.get(f"{url}/v1/models").json()["data"]
    base = models[0]["id"]
    assert {m["id"]: m.get("parent") for m in models} == {
        base: None, **{name: base for name in ADAPTERS}}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for model, adapter in (("attn8", "attn8"), (f"{base}:mlp16", "mlp16"), (base, None)):
        reply = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        native = httpx.post(f"{url}/generate", json={
            "text": PROMPTS[2], "sampling_params": greedy, "lora_path": adapter},
            timeout=60).json()
        assert reply.choices[0].text == native["text"], model
        assert native["output_ids"] == expected[(adapter, PROMPTS[2])]
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)
    bad = httpx.post(f"{url}/generate", json={"text": "x", "lora_path": "nope"})
    assert bad.status_code == 400 and "lora_path" in bad.text


def test_http_load_and_unload(lora_server, lora_setup, make_engine):
    import httpx

    from tests.conftest import serve_in_thread

    _, folders, expected = lora_setup
    url = lora_server.base_url
    loaded = httpx.post(f"{url}/load_lora_adapter",
                        json={"lora_name": "extra", "lora_path": str(folders["mlp16"])}).json()
    assert loaded["success"] and "extra" in loaded["loaded_adapters"]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{url}/generate", json={"text": PROMPTS[0], "sampling_params": greedy,
                                              "lora_path": "extra"}, timeout=60).json()
    assert out["output_ids"] == expected[("mlp16", PROMPTS[0])]
    again = httpx.post(f"{url}/load_lora_adapter",
                       json={"lora_name": "extra", "lora_path": str(folders["attn8"])})
    assert again.status_code == 400 and "already loaded" in again.text
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}).json()
    assert "extra" not in gone["loaded_adapters"]
    missing = httpx.post(f"{url}/load_lora_adapter",
                         json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert missing.status_code == 400 and "not a folder" in missing.text
    # Without --enable-lora (adapters from --lora-paths only) nothing is loaded over HTTP.
    fixed = serve_in_thread(lora_engine(make_engine, lora_setup))
    try:
        refused = httpx.post(f"{fixed.base_url}/load_lora_adapter",
                             json={"lora_name": "x", "lora_path": str(folders["attn8"])})
        assert refused.status_code == 400 and "--enable-lora" in refused.text
    finally:
        fixed.stop()


def test_programs_run_through_an_adapter_in_process_and_over_http(make_engine, lora_setup,
                                                                  lora_server):
    import forklm as sgl

    engine = lora_engine(make_engine, lora_setup, enable_lora=True)

    @sgl.function
    def complete(s, prompt):
        s += prompt + sgl.gen("out", max_tokens=NEW_TOKENS, ignore_eos=True)
        s += " Verdict:" + sgl.select("verdict", ["yes", "no"])

    texts = {}
    for adapter in (None, "attn8", "all8rs"):
        direct = engine.generate(PROMPTS[1], GREEDY, lora_path=adapter)["text"]
        local = complete.run(PROMPTS[1], backend=sgl.EngineBackend(engine, lora_path=adapter),
                             temperature=0)
        remote_backend = sgl.RuntimeEndpoint(lora_server.base_url, lora_path=adapter)
        try:
            remote = complete.run(PROMPTS[1], backend=remote_backend, temperature=0)
            assert local["out"] == remote["out"] == direct, adapter
            local_scores = local.get_meta_info("verdict")["normalized_prompt_logprobs"]
            remote_scores = remote.get_meta_info("verdict")["normalized_prompt_logprobs"]
            assert local_scores == pytest.approx(remote_scores, abs=1e-4)
        finally:
            remote_backend.close()
        texts[adapter] = (local["out"], local_scores)
    assert len({out for out, _ in texts.values()}) == 3  # each adapter says something else


@pytest.mark.slow
def test_an_adapter_on_the_default_model_matches_peft(make_engine, hf_model, tokenizer,
                                                     tmp_path):
    """A real model (SmolLM2-135M, 30 layers, tied embeddings) with an adapter on every
    projection: forklm's greedy tokens, alone and beside base-model requests, equal PEFT's."""
    import copy

    from tests.conftest import EVAL_QUESTIONS, chat_prompt, hf_greedy

    peft_model = make_adapter(copy.deepcopy(hf_model), tmp_path / "smol", seed=7, r=8,
                              lora_alpha=16, target_modules=ATTENTION + MLP)
    for name, p in peft_model.named_parameters():  # updates the size of the base's own
        if "lora_" in name:
            p.data.mul_(0.5)
    peft_model.save_pretrained(tmp_path / "smol")
    engine = make_engine(lora_paths=(f"smol={tmp_path / 'smol'}",))
    prompts = [chat_prompt(tokenizer, q) for q in EVAL_QUESTIONS[:2]]
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    expected = [hf_greedy(peft_model, i, 16) for i in ids]
    base = [hf_greedy(hf_model, i, 16) for i in ids]
    assert expected != base
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    results = engine.generate(input_ids=ids + ids, sampling_params=params,
                              lora_path=["smol", "smol", None, None])
    assert [r["output_ids"] for r in results] == expected + base
    del peft_model


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_batch_of_adapters_adds_each_rows_own_update(data):
    """LoraLinear on random adapters (some leaving the module alone), ranks, scalings and row
    assignments, one adapter or several (the stacked path): every row gets exactly its own
    adapter's (x A^T) B^T * scaling, base rows nothing, against a float64 reference."""
    from forklm.runtime.lora.adapter import LoraWeights, ModuleDelta
    from forklm.runtime.lora.layers import LoraBatch, LoraLinear

    in_f, out_f = 12, 10
    base = torch.nn.Linear(in_f, out_f, bias=False).double()
    num_adapters = data.draw(st.integers(1, 4))
    adapters = []
    for uid in range(num_adapters):
        modules = {}
        if data.draw(st.booleans()) or uid == 0:  # adapter 0 always updates the module
            rank = data.draw(st.integers(1, 5))
            modules["m"] = ModuleDelta(torch.randn(rank, in_f, dtype=torch.float64),
                                       torch.randn(out_f, rank, dtype=torch.float64),
                                       data.draw(st.floats(0.1, 4.0)))
        adapters.append(LoraWeights(f"a{uid}", uid + 1, modules))
    rows = data.draw(st.integers(1, 9))
    owner = data.draw(st.lists(st.integers(-1, num_adapters - 1), min_size=rows, max_size=rows))
    batch = LoraBatch()
    layer = LoraLinear(base, "m", batch)
    present = sorted({o for o in owner if o >= 0})
    batch.groups = [(adapters[a], None if all(o == a for o in owner) else
                     torch.tensor([i for i, o in enumerate(owner) if o == a]))
                    for a in present]
    batch.key = tuple(adapters[a].uid for a in present)
    batch.row_groups = (torch.tensor([present.index(o) if o >= 0 else -1 for o in owner])
                        if len(present) > 1 else None)
    x = torch.randn(rows, in_f, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)
        expected = base(x).clone()
        for i, o in enumerate(owner):
            delta = adapters[o].modules.get("m") if o >= 0 else None
            if delta is not None:
                expected[i] += (x[i] @ delta.a.T) @ delta.b.T * delta.scaling
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
