"""Every architecture forklm serves, as a tiny random transformers checkpoint: greedy tokens (alone,
batched, over a cached prefix, with chunked prefill) and prompt logprobs equal transformers' in
fp32. Prompts and generations run past the sliding windows (8) of the models that have them."""

from __future__ import annotations

import functools
import json
import pathlib

import pytest
import torch
import transformers

from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import UnsupportedModelError
from tests.conftest import assert_idle_and_clean, hf_greedy
from tests.tiny_models import ARCHITECTURES, SLIDING_WINDOW, build_tiny_model

NUM_NEW = 24
GREEDY = {"temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True}
TEXTS = [  # 5, 14, 23 and 41 tokens with the default tokenizer
    "Paris is the capital of",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A radix tree stores strings by their shared prefixes, so a lookup walks one edge per "
    "distinct run of characters.",
    "Once upon a time, in a village by the mountains, there lived an old clockmaker who repaired "
    "every clock in town except his own, which had stopped at midnight many years before anyone "
    "could remember why.",
]
LOGPROB_ATOL = 1e-4


class TinyCase:
    """One architecture: its transformers model, saved folder, and forklm engines built on first
    use (so a model forklm refuses fails the tests that need it, not the fixture)."""

    def __init__(self, name: str, folder: pathlib.Path, tokenizer, prompts: list[list[int]]):
        self.name, self.folder, self.prompts = name, folder, prompts
        self.hf_model = build_tiny_model(name, folder, tokenizer)
        self._engines: list[Engine] = []

    @functools.cached_property
    def reference(self) -> list[list[int]]:
        return [hf_greedy(self.hf_model, ids, NUM_NEW) for ids in self.prompts]

    def _engine(self, **config) -> Engine:
        engine = Engine(model_path=str(self.folder), dtype="float32", max_total_tokens=2048,
                        debug_check_invariants=True,
                        **ARCHITECTURES[self.name].engine_config, **config)
        self._engines.append(engine)
        return engine

    @functools.cached_property
    def engine(self) -> Engine:
        return self._engine()

    @functools.cached_property
    def chunked_engine(self) -> Engine:
        return self._engine(chunked_prefill_size=4, disable_radix_cache=True)

    def shutdown(self) -> None:
        for engine in self._engines:
            engine.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert max(len(p) for p in ids) > 4 * SLIDING_WINDOW and min(len(p) for p in ids) >= 5
    return ids


# Module scope with params: pytest runs every test of one architecture before building the next,
# and shuts its engines down in between, so one tiny model and two engines are alive at a time.
@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def case(request, tokenizer, prompts, tmp_path_factory):
    tiny = TinyCase(request.param, tmp_path_factory.mktemp(request.param), tokenizer, prompts)
    yield tiny
    tiny.shutdown()


def _outputs(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_one_at_a_time(case):
    engine = case.engine
    assert [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
            for p in case.prompts] == case.reference
    assert_idle_and_clean(engine)


# Architectures whose decode runs through FusedDecodeLayers (runtime/models/fused_layers.py)
# on this CPU (the tiny Phi-3 rotates whole heads; SmolLM3's NoPE layers rotate by an identity
# table); the others (GELU, sandwich or post norms, MoE, Granite's residual scale) run the eager
# layers.
FUSED = {"llama3", "qwen2", "qwen2_sliding", "qwen3", "mistral", "phi3", "phi3_short", "smollm3"}


def test_fused_layers_where_the_model_allows(case):
    """The tests above run the fused decode layers for these models (so their tokens are the
    fused path's): which ones take it is part of what they check."""
    from forklm.kernels.cpu import bindings as native_kernels

    if native_kernels.fused_ops() is None:  # no C compiler: every model runs eagerly
        assert case.engine.parts.runner.model.fused_layers is None
        return
    fused = case.engine.parts.runner.model.fused_layers is not None
    assert fused == (case.name in FUSED), case.name


def test_all_together(case):
    engine = case.engine
    engine.flush_cache()
    assert _outputs(engine.generate(input_ids=case.prompts, sampling_params=GREEDY)) == case.reference
    assert_idle_and_clean(engine)


def test_prefix_already_cached(case):
    engine = case.engine
    engine.flush_cache()
    halves = [p[: len(p) // 2] for p in case.prompts]
    engine.generate(input_ids=halves, sampling_params={"temperature": 0, "max_new_tokens": 1})
    results = engine.generate(input_ids=case.prompts, sampling_params=GREEDY)
    assert _outputs(results) == case.reference
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    assert all(c >= len(h) for c, h in zip(cached, halves)), cached
    assert_idle_and_clean(engine)


def test_chunked_prefill(case):
    engine = case.chunked_engine
    results = engine.generate(input_ids=case.prompts, sampling_params=GREEDY)
    assert _outputs(results) == case.reference
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)
    assert_idle_and_clean(engine)


def test_logits_match_transformers(case):
    """Prompt logprobs of the chosen tokens and the top 5 at every position, within 1e-4."""
    for ids in case.prompts:
        res = case.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                                   return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
        with torch.inference_mode():
            ref = torch.log_softmax(case.hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        ours = torch.tensor([lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
        expect = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(ours, expect, atol=LOGPROB_ATOL, rtol=0)
        for t, top in enumerate(res["meta_info"]["input_top_logprobs"][1:]):
            values, indices = ref[t].topk(5)
            assert [tid for _, tid, _ in top] == indices.tolist(), f"position {t}"
            torch.testing.assert_close(torch.tensor([lp for lp, _, _ in top]), values,
                                       atol=LOGPROB_ATOL, rtol=0)


# ---- refusals -------------------------------------------------------------------------------


def test_unsupported_architecture_is_refused(tmp_path, tokenizer):
    config = transformers.GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=64)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=256)
    message = str(info.value)
    assert "gpt_neox" in message
    assert all(name in message for name in ("llama", "qwen2", "gemma2", "phi3", "mixtral"))


def test_a_family_needing_a_missing_mechanism_is_refused_naming_it(tmp_path, tokenizer):
    config = transformers.MambaConfig(vocab_size=len(tokenizer), hidden_size=64,
                                      num_hidden_layers=1)
    transformers.MambaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported .it needs state"):
        Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=256)


@pytest.mark.parametrize("field, value", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("hidden_act", "quick_gelu"),  # relu2 is honoured (Nemotron)
], ids=["rope_dynamic", "hidden_act_quick_gelu"])
def test_unhonoured_config_field_is_refused(tmp_path, tokenizer, field, value):
    """A Llama checkpoint whose config asks for something forklm does not compute is refused, and
    the message names the field and its value (never silently served with default behaviour)."""
    build_tiny_model("llama3", tmp_path, tokenizer)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config[field] = value
    config_file.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=256)
    shown = value["rope_type"] if isinstance(value, dict) else value
    assert shown in str(info.value)
    assert ("rope_type" if isinstance(value, dict) else field) in str(info.value)


@pytest.mark.parametrize("num_heads", [1, 2, 6, 8, 12, 16, 30, 32, 40, 112])
def test_alibi_slopes_are_blooms(num_heads):
    """forklm's ALiBi slopes equal transformers' BLOOM ones, powers of two or not (BLOOM-176B
    has 112 heads)."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    from forklm.runtime.models.layers import alibi_slopes

    ours = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)
    torch.testing.assert_close(ours, _get_alibi_slopes(num_heads, torch.device("cpu")),
                               rtol=1e-6, atol=0)


def test_bloom_checkpoint_without_the_transformer_prefix(tmp_path, tokenizer):
    """BigScience's own BLOOM checkpoints name their tensors without `transformer.` (h.0...,
    word_embeddings...): they load as the prefixed ones do."""
    from safetensors.torch import load_file, save_file

    model = build_tiny_model("bloom", tmp_path, tokenizer)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    assert any(name.startswith("transformer.") for name in tensors)
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, path,
              metadata={"format": "pt"})
    ids = tokenizer.encode(TEXTS[1])
    with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=512) as engine:
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    assert out == hf_greedy(model, ids, NUM_NEW)


def test_bloom_residual_after_the_norm_is_refused():
    from forklm.runtime.models.spec import spec_from_config

    config = transformers.BloomConfig(apply_residual_connection_post_layernorm=True)
    with pytest.raises(UnsupportedModelError, match="apply_residual_connection_post_layernorm"):
        spec_from_config(config)


@pytest.mark.parametrize("num_heads", [1, 4, 6, 8, 12, 32, 56])
def test_mpt_alibi_slopes_are_transformers(num_heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from forklm.runtime.models.layers import mpt_alibi_slopes

    # the bias of key 0 of 2 is -1 * slope
    theirs = -build_mpt_alibi_tensor(num_heads, 2, alibi_bias_max=8)[:, 0, 0]
    torch.testing.assert_close(torch.tensor(mpt_alibi_slopes(num_heads, 8), dtype=torch.float32),
                               theirs.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_alibi_models_under_deterministic_inference(name, tmp_path, tokenizer):
    """The batch-invariant attention biases ALiBi models too: greedy tokens, batched with a
    radix-cached prefix and chunked prefill, equal transformers'."""
    model = build_tiny_model(name, tmp_path, tokenizer)
    prompts = [tokenizer.encode(text) for text in TEXTS[:3]]
    with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024,
                enable_deterministic_inference=True, chunked_prefill_size=8) as engine:
        assert type(engine.parts.runner.attn).__name__ == "BatchInvariantAttention"
        engine.generate(input_ids=prompts[2][:10], sampling_params=GREEDY)  # cache a prefix
        outs = _outputs(engine.generate(input_ids=prompts, sampling_params=GREEDY))
    assert outs == [hf_greedy(model, ids, NUM_NEW) for ids in prompts]


def _mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, out, in] float -> MXFP4 blocks [experts, out, in / 32, 16] and scales: per group
    of 32 a power-of-two scale putting its largest magnitude within E2M1's 6, codes the nearest
    E2M1 value (the low nibble the even element)."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - values).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_gpt_oss_with_the_hubs_mxfp4_experts(tmp_path, tokenizer):
    """The hub's gpt-oss checkpoints pack their experts in MXFP4 (`*_blocks`, `*_scales`, a
    `quantization_config`): forklm dequantizes them as transformers' own dequantization does,
    so greedy tokens equal transformers' on those dequantized experts."""
    import safetensors.torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from forklm.runtime.models.checkpoint_layouts import mxfp4_dequantize

    model = build_tiny_model("gpt_oss", tmp_path, tokenizer)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4_pack(state.pop(name).transpose(1, 2))  # packed as [out, in]
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(torch.stack([mxfp4_dequantize(b, s) for b, s in zip(blocks, scales)]),
                           reference.transpose(1, 2))
        with torch.no_grad():  # the reference model computes with the dequantized experts
            model.get_parameter(name).copy_(reference)
    (tmp_path / "model.safetensors").unlink()
    safetensors.torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [tokenizer.encode(text) for text in TEXTS[:2]]
    with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=512) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in results] == [hf_greedy(model, ids, NUM_NEW) for ids in prompts]


def test_gpt_oss_with_other_quantization_is_refused(tokenizer):
    from forklm.runtime.models.spec import spec_from_config
    from tests.tiny_models import tiny_config

    config = tiny_config("gpt_oss", tokenizer)
    config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(UnsupportedModelError, match="quantization_config='bitsandbytes'"):
        spec_from_config(config)
