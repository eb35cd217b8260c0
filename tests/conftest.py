"""Shared fixtures: the default model loaded once per session, a transformers reference model on the
same weights, and engines built on demand (cached per config so tests share them)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
import transformers

from forklm.runtime.engine import Engine
from forklm.runtime.model_loader import LoadedModel, load_model

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(default_model: LoadedModel):
    return default_model.tokenizer


@pytest.fixture(scope="session")
def hf_model(default_model: LoadedModel) -> transformers.PreTrainedModel:
    """transformers' own Llama on the same fp32 weights: the correctness reference."""
    model = transformers.LlamaForCausalLM(default_model.config)
    missing, unexpected = model.load_state_dict(default_model.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.float().eval()


_engines: dict[tuple, Engine] = {}


@pytest.fixture(scope="session")
def make_engine():
    """make_engine(**config) -> an Engine on the default model, shared by tests asking the same
    config. Every engine checks its KV invariants after every step."""

    def make(**config) -> Engine:
        config.setdefault("dtype", "float32")
        config.setdefault("max_total_tokens", 8192)
        config.setdefault("debug_check_invariants", True)
        key = tuple(sorted(config.items()))
        if key not in _engines:
            _engines[key] = Engine(**config)
        return _engines[key]

    yield make
    for engine in _engines.values():
        engine.shutdown()
    _engines.clear()


def assert_idle_and_clean(engine: Engine) -> None:
    """No step failed, the KV accounting holds, and no request is left or still owns a slot."""
    assert engine.last_error is None
    engine.check_invariants()
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["kv_used"]) == (0, 0, 0)


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


@torch.inference_mode()
def hf_greedy(hf_model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding with its KV cache, never stopping at EOS (like ignore_eos)."""
    out = hf_model(torch.tensor([input_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                       use_cache=True)
    return tokens
