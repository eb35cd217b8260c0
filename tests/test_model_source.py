"""Tests for model sources: Hub ids resolved through a Hugging Face cache built by hand in a
temporary HF_HOME (offline, nothing downloaded), local paths, the default model's names."""

from __future__ import annotations

import hashlib
import pathlib
import types

import huggingface_hub
import pytest
import torch
import transformers
from huggingface_hub import errors as hub_errors
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from forklm.runtime.errors import ModelNotFoundError
from forklm.runtime.models import source as model_source
from forklm.runtime.models.source import (
    default_model_gguf,
    resolve_model_source,
    resolve_tokenizer_source,
)
from tests.conftest import hf_greedy

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY = dict(vocab_size=256 + len(SPECIALS), hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, eos_token_id=256, tie_word_embeddings=False)


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per byte, then the special tokens."""
    vocab = {tok: i for i, tok in enumerate([*bytes_to_unicode().values(), *SPECIALS])}
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:])


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    """A random 1-layer Llama and its tokenizer, as the files of a Hub repo."""
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"never fetched")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty HF cache under a fresh HF_HOME, offline and without a token; set after
    huggingface_hub was imported, as a launcher would."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hf" / "hub"


def cache_repo(cache: pathlib.Path, repo_id: str, files: dict[str, bytes],
               commit: str = COMMIT_A, refs: tuple[str, ...] = ("main",)) -> pathlib.Path:
    """Lay `files` out as huggingface_hub does: content-addressed blobs, a snapshot folder per
    commit of relative symlinks to them, and refs/<branch> holding the commit (no newline)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(pathlib.Path("../" * (name.count("/") + 2)) / "blobs" / blob.name)
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


# ---- Hub ids --------------------------------------------------------------------------------


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache, tiny_files):
    snapshot = cache_repo(hub_cache, "org/tiny", tiny_files)
    path = resolve_model_source("org/tiny")
    assert path == snapshot
    assert transformers.AutoConfig.from_pretrained(path).hidden_size == 32


def test_hf_hub_cache_wins_over_hf_home(hub_cache, tiny_files, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    snapshot = cache_repo(other, "org/tiny", tiny_files)
    assert resolve_model_source("org/tiny") == snapshot


def test_revision_picks_a_branch_or_a_commit(hub_cache, tiny_files):
    old = cache_repo(hub_cache, "org/tiny", tiny_files, COMMIT_A, refs=("main",))
    new = cache_repo(hub_cache, "org/tiny", tiny_files, COMMIT_B, refs=("dev",))
    assert resolve_model_source("org/tiny") == old
    assert resolve_model_source("org/tiny", revision="dev") == new
    assert resolve_model_source("org/tiny", revision=COMMIT_B) == new
    with pytest.raises(ModelNotFoundError, match="revision 'v9'.*--revision v9"):
        resolve_model_source("org/tiny", revision="v9")


def test_uncached_id_says_how_to_fetch_it(hub_cache):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_source("org/missing")
    message = str(info.value)
    assert "model_path='org/missing'" in message
    assert "hf download org/missing" in message and "HF_HUB_OFFLINE" in message
    assert str(hub_cache) in message


def test_missing_shard_says_how_to_fetch_it(hub_cache, tiny_files):
    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    files["model.safetensors.index.json"] = b'{"weight_map": {"a": "model-1.safetensors", ' \
                                           b'"b": "model-2.safetensors"}}'
    files["model-1.safetensors"] = tiny_files["model.safetensors"]
    cache_repo(hub_cache, "org/sharded", files)
    with pytest.raises(ModelNotFoundError, match="model-2.safetensors.*hf download org/sharded"):
        resolve_model_source("org/sharded")


def test_gguf_repos(hub_cache):
    many = cache_repo(hub_cache, "org/many", {"m.Q4_0.gguf": b"q4", "m.Q8_0.gguf": b"q8",
                                             "README.md": b"hi"})
    assert resolve_model_source("org/many/m.Q8_0.gguf") == many / "m.Q8_0.gguf"
    with pytest.raises(ModelNotFoundError, match="2 .gguf files.*'org/many/m.Q4_0.gguf'"):
        resolve_model_source("org/many")
    with pytest.raises(ModelNotFoundError, match="hf download org/many"):
        resolve_model_source("org/many/m.Q2_K.gguf")
    one = cache_repo(hub_cache, "org/one", {"only.gguf": b"q4"})
    assert resolve_model_source("org/one") == one / "only.gguf"


def test_a_local_path_wins(hub_cache, tiny_files, tmp_path, monkeypatch):
    cache_repo(hub_cache, "org/tiny", tiny_files)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    (tmp_path / "org" / "tiny" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_source("org/tiny", revision="dev") == pathlib.Path("org/tiny")
    (tmp_path / "org" / "tiny" / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model_source("org/tiny")  # an existing local path is never looked up on the Hub


@pytest.mark.parametrize("name", ["./nope", "a/b/c", "org--x/y", "/no/such.gguf"])
def test_not_a_hub_id_keeps_the_local_message(hub_cache, name):
    with pytest.raises(ModelNotFoundError, match=r"tokenizer_path=.*no such file or folder.*"
                                                 r"Expected a .gguf file"):
        resolve_model_source(name, what="tokenizer_path")


def test_default_names_resolve_to_the_installed_gguf(hub_cache):
    assert resolve_model_source("SmolLM2-135M-Instruct") == default_model_gguf()
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct") == default_model_gguf()


def test_default_hub_name_prefers_a_cached_snapshot(hub_cache, tiny_files):
    snapshot = cache_repo(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct", tiny_files)
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot
    assert resolve_model_source("SmolLM2-135M-Instruct") == default_model_gguf()


def test_tokenizer_source_skips_the_weights(hub_cache, tiny_files):
    snapshot = cache_repo(hub_cache, "org/tok", {k: v for k, v in tiny_files.items()
                                                 if "tokenizer" in k})
    assert resolve_tokenizer_source("org/tok") == snapshot
    assert transformers.AutoTokenizer.from_pretrained(snapshot).encode("hi!") == \
        _tiny_tokenizer().encode("hi!")
    with pytest.raises(ModelNotFoundError, match="tokenizer_path='org/none'"):
        resolve_tokenizer_source("org/none")


# ---- What is asked of huggingface_hub -------------------------------------------------------


def _record_calls(monkeypatch, error: Exception | None = None) -> list[dict]:
    calls: list[dict] = []

    def snapshot_download(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        if error is not None:
            raise error
        return "/nowhere"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_environment_is_read_at_call_time(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = _record_calls(monkeypatch, hub_errors.LocalEntryNotFoundError("no"))
    with pytest.raises(ModelNotFoundError, match="cannot be reached"):
        resolve_model_source("org/tiny", revision="dev")
    (call,) = calls
    assert call["token"] == "hf_secret" and call["revision"] == "dev"
    assert call["cache_dir"] == str(hub_cache) and call["local_files_only"] is False
    patterns = call["allow_patterns"]
    assert {"*.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= set(patterns)
    assert not any(p.endswith((".bin", ".pt", ".gguf", ".onnx")) or p == "*" for p in patterns)


def test_tokenizer_fetch_asks_for_no_weights(hub_cache, monkeypatch):
    calls = _record_calls(monkeypatch, hub_errors.LocalEntryNotFoundError("no"))
    with pytest.raises(ModelNotFoundError):
        resolve_tokenizer_source("org/tiny")
    assert calls[0]["local_files_only"] is True
    assert not any("safetensors" in p for p in calls[0]["allow_patterns"])


@pytest.mark.parametrize(("error", "status", "expected"), [
    (hub_errors.GatedRepoError, 403, "gated.*set HF_TOKEN"),
    (hub_errors.RepositoryNotFoundError, 401, "private.*set HF_TOKEN"),
    (hub_errors.HfHubHTTPError, 403, "refused.*set HF_TOKEN"),
    (hub_errors.RevisionNotFoundError, 404, "no such revision"),
])
def test_hub_refusals_say_what_to_do(hub_cache, monkeypatch, error, status, expected):
    response = types.SimpleNamespace(headers={}, request=None, status_code=status)
    _record_calls(monkeypatch, error("refused", response=response))
    with pytest.raises(ModelNotFoundError, match=f"model_path='org/tiny'.*{expected}"):
        resolve_model_source("org/tiny")


def test_parse_hub_id():
    parse = model_source.parse_hub_id
    assert parse("org/name") == ("org/name", None)
    assert parse("org/name/f.Q4_K_M.gguf") == ("org/name", "f.Q4_K_M.gguf")
    for name in ("name", "org/name/x.bin", "./org/name", "~/org/name", "org/../x", "/org/name"):
        assert parse(name) is None, name


# ---- The engine and the command line --------------------------------------------------------


def test_engine_on_a_hub_id_equals_transformers(hub_cache, tiny_files):
    from forklm.runtime.engine.engine import Engine

    snapshot = cache_repo(hub_cache, "org/tiny", tiny_files)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(snapshot).float().eval()
    prompt_ids = list(b"The capital of France is")
    expected = hf_greedy(hf_model, prompt_ids, 12)
    with Engine(model_path="org/tiny", dtype="float32", max_total_tokens=256) as engine:
        out = engine.generate(input_ids=prompt_ids, sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert out["output_ids"] == expected


def test_serve_flags_name_the_model():
    from forklm.cli import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    help_text = serve.format_help()
    for flag in ("--model-path", "--revision", "--tokenizer-path", "--served-model-name"):
        assert flag in help_text, flag
    args = parser.parse_args(["serve", "--model-path", "org/x", "--served-model-name", "m",
                              "--revision", "dev", "--tokenizer-path", "org/tok"])
    assert (args.model_path, args.served_model_name) == ("org/x", "m")
    assert (args.revision, args.tokenizer_path) == ("dev", "org/tok")
