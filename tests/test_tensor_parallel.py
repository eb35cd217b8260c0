"""Tensor parallelism (runtime/distributed/): tp_size=2 over gloo in float32 gives the greedy tokens
tp_size=1 gives, on a tiny GQA model whose 3 KV heads do not split over 2 ranks (batching, radix
cache hits, chunked prefill, retraction) and on the default model through `forklm serve` and the
openai client; two "nodes" on 127.0.0.1; a worker killed mid-run fails the engine's requests
within seconds and nothing hangs."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from forklm.runtime.config import EngineConfig
from forklm.runtime.distributed.sharding import ShardPlan, check_shardable
from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import EngineShutdownError, InvalidArgumentError, UnsupportedModelError
from forklm.runtime.models.layers import alibi_slopes
from forklm.runtime.models.spec import ModelSpec, MoESpec
from tests.conftest import EVAL_QUESTIONS, assert_idle_and_clean
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow

# 6 query heads over 3 KV heads, split over 2 ranks as whole GQA groups: 4 heads and KV heads 0, 1
# on rank 0, 2 heads and KV head 2 on rank 1 (uneven, as the default model's 9 over 3 are).
TINY = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
# A small pool, short chunks and an eager admission: 8 requests force chunked prefill and
# retraction (checked below), and the radix cache serves the repeated prefixes.
ENGINE = dict(dtype="float32", max_total_tokens=192, chunked_prefill_size=16,
              schedule_conservativeness=0.3, debug_check_invariants=True)


def _spec(heads: int, kv_heads: int, **extra) -> ModelSpec:
    fields = dict(model_type="llama", vocab_size=101, hidden_size=heads * 4, intermediate_size=12,
                  num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=4,
                  norm_eps=1e-6, tie_word_embeddings=True)
    return ModelSpec(**{**fields, **extra})


@pytest.mark.parametrize("heads,kv_heads,tp", [(6, 3, 2), (9, 3, 2), (4, 1, 2), (8, 4, 2),
                                               (4, 2, 4), (12, 3, 2), (8, 8, 4), (6, 2, 3),
                                               (8, 2, 4), (12, 2, 4)])
def test_each_rank_keeps_the_kv_heads_its_query_heads_read(heads, kv_heads, tp):
    group = heads // kv_heads
    plans = [ShardPlan(_spec(heads, kv_heads), rank, tp) for rank in range(tp)]
    assert [p.head_start for p in plans] == list(itertools.accumulate(
        [0] + [p.num_heads for p in plans]))[:-1]  # contiguous blocks ...
    assert sum(p.num_heads for p in plans) == heads  # ... covering every head once
    for plan in plans:
        local = plan.local_spec
        assert local.num_heads % local.num_kv_heads == 0 and local.num_heads > 0
        for j in range(local.num_heads):  # local query head j is global head_start + j
            assert plan.kv_heads[j // plan.kv_group] == (plan.head_start + j) // group
        if kv_heads >= tp:  # whole GQA groups: no KV head is held twice
            assert local.num_kv_heads * group == local.num_heads


def test_each_rank_keeps_its_heads_alibi_slopes():
    slopes = alibi_slopes(12)
    plans = [ShardPlan(_spec(12, 12, alibi_slopes=slopes), rank, 3) for rank in range(3)]
    assert [p.local_spec.alibi_slopes for p in plans] == [slopes[:4], slopes[4:8], slopes[8:]]


def test_shards_put_back_together_give_the_checkpoint():
    import torch

    spec = _spec(6, 3)
    plans = [ShardPlan(spec, rank, 2) for rank in range(2)]
    full = {"model.embed_tokens.weight": torch.randn(101, 24),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(24, 24),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(24, 24),
            "model.layers.0.self_attn.o_proj.bias": torch.randn(24),
            "model.layers.0.mlp.gate_up_proj.weight": torch.randn(24, 24),
            "model.layers.0.mlp.down_proj.weight": torch.randn(24, 12),
            "model.norm.weight": torch.randn(24)}
    shards = [dict(kv for name, t in full.items() for kv in p.shard(name, t)) for p in plans]
    cat = lambda name, dim: torch.cat([s[name] for s in shards], dim)  # noqa: E731
    assert torch.equal(cat("model.embed_tokens.weight", 0)[:101], full["model.embed_tokens.weight"])
    assert not cat("model.embed_tokens.weight", 0)[101:].any()  # vocabulary padding: zeros
    for name, dim in [("model.layers.0.self_attn.q_proj.weight", 0),
                      ("model.layers.0.self_attn.o_proj.weight", 1),
                      ("model.layers.0.mlp.down_proj.weight", 1)]:
        assert torch.equal(cat(name, dim), full[name]), name
    gate_up = full["model.layers.0.mlp.gate_up_proj.weight"]  # Phi-3's fused MLP comes back split
    assert torch.equal(cat("model.layers.0.mlp.gate_proj.weight", 0), gate_up[:12])
    assert torch.equal(cat("model.layers.0.mlp.up_proj.weight", 0), gate_up[12:])
    bias = [s["model.layers.0.self_attn.o_proj.bias"] for s in shards]  # added once, by rank 0
    assert torch.equal(bias[0] + bias[1], full["model.layers.0.self_attn.o_proj.bias"])
    assert all(torch.equal(s["model.norm.weight"], full["model.norm.weight"]) for s in shards)


def test_what_cannot_be_split_is_refused_naming_the_flag():
    moe = MoESpec(num_experts=4, top_k=2, intermediate_size=8, renormalize=True)
    for spec, tp in ((_spec(6, 3, moe=moe), 2), (_spec(6, 3), 4), (_spec(9, 3), 4),
                     (_spec(4, 2, intermediate_size=3), 4),
                     (_spec(6, 3, qk_norm="proj"), 2), (_spec(6, 3, qk_norm="each_head"), 2)):
        with pytest.raises(UnsupportedModelError, match="tp_size="):
            check_shardable(spec, tp)
    bad = [dict(tp_size=0), dict(tp_size=4, nnodes=3), dict(nnodes=2, tp_size=2),
           dict(tp_size=2, node_rank=1), dict(tp_size=2, quantization="gguf"),
           dict(tp_size=2, dist_init_addr="nohost"), dict(tp_size=2, device="cuda:1")]
    for fields in bad:
        with pytest.raises(InvalidArgumentError):
            EngineConfig(**fields)
    assert EngineConfig(tp_size=4, nnodes=2, dist_init_addr="h:1").local_tp_size == 2


def test_each_rank_takes_its_share_of_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert EngineConfig(tp_size=2).threads_per_rank == max(1, cores // 2)
    assert EngineConfig(tp_size=4, nnodes=2, dist_init_addr="h:1").threads_per_rank == max(
        1, cores // 2)  # 2 ranks on each node
    assert EngineConfig(tp_size=2, num_threads=3).threads_per_rank == 3
    assert EngineConfig().threads_per_rank is None  # one process: torch's default


# ---- a tiny model in this process: rank 0 here, rank 1 a spawned worker ------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny_tp")
    build_tiny_model("llama3", folder, tokenizer, **TINY)
    return str(folder)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """8 prompts of 6 to ~60 tokens, two pairs sharing long prefixes."""
    texts = EVAL_QUESTIONS[:6] + [EVAL_QUESTIONS[2] + " Then add them.",
                                  EVAL_QUESTIONS[5] + " Give an example."]
    return [tokenizer.encode(t * (1 + i % 3)) for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def engines(tiny_folder):
    """(tp_size=1, tp_size=2) engines of the same config; the TP one's worker is killed by the
    last test of this module, so they are not shared beyond it."""
    single = Engine(tiny_folder, **ENGINE)
    parallel = Engine(tiny_folder, tp_size=2, **ENGINE)
    yield single, parallel
    parallel.shutdown()
    single.shutdown()


def _ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_batch_with_chunks_and_retraction_matches_tp1(engines, prompts, caplog):
    single, parallel = engines
    with caplog.at_level(logging.INFO, logger="forklm.runtime.scheduling.scheduler"):
        got = _ids(parallel.generate(input_ids=prompts, sampling_params=GREEDY))
    assert any("retracted" in r.getMessage() for r in caplog.records), "no retraction happened"
    assert max(map(len, prompts)) > ENGINE["chunked_prefill_size"]  # prefilled in chunks
    assert got == _ids(single.generate(input_ids=prompts, sampling_params=GREEDY))
    assert_idle_and_clean(parallel)


def test_radix_cache_hits_keep_the_tokens(engines, prompts):
    single, parallel = engines
    again = [p + [13] for p in prompts[:3]]  # cached prefixes plus one new token
    first = parallel.generate(input_ids=prompts[:3], sampling_params=GREEDY)
    second = parallel.generate(input_ids=again, sampling_params=GREEDY)
    assert all(r["meta_info"]["cached_tokens"] > 0 for r in second)
    assert _ids(first) + _ids(second) == _ids(
        single.generate(input_ids=prompts[:3] + again, sampling_params=GREEDY))
    one = parallel.generate(input_ids=prompts[0], sampling_params=GREEDY)  # batch 1 decode
    assert one["output_ids"] == _ids(first)[0]
    assert_idle_and_clean(parallel)


def test_killed_worker_fails_requests_within_seconds(engines, prompts):
    """Last of the tiny-model tests: it breaks the module's TP engine."""
    _, parallel = engines
    pid = parallel.parts.runner.workers.pids[1]
    chunks: list[dict] = []
    long = {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True}

    def read() -> None:
        for chunk in parallel.generate(input_ids=prompts[0], sampling_params=long, stream=True):
            chunks.append(chunk)
            if len(chunks) == 2:  # mid-run: the request has decoded a token or two
                os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(timeout=15)
    assert not thread.is_alive(), "the request did not fail"
    reason = chunks[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "worker lost" in reason["message"], reason
    assert "exited with code -9" in reason["message"]
    assert sum(len(c["output_ids"]) for c in chunks) < 150  # cut short
    deadline = time.monotonic() + 10
    while not parallel.closed:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(EngineShutdownError):
        parallel.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert not parallel.parts.runner.workers.procs[1].is_alive()


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "bloom"])
def test_other_dense_families_match_tp1(arch, tmp_path, tokenizer, prompts):
    """qwen2: q/k/v biases and an untied LM head; gemma2: soft-caps, sandwich norms, a scaled
    embedding and sliding windows, head_dim 32; bloom: ALiBi (each rank its heads' slopes), a
    norm after the vocabulary-parallel embedding. Runs after the module's TP engine is shut
    down (one TP engine per process)."""
    build_tiny_model(arch, tmp_path, tokenizer)
    with Engine(str(tmp_path), dtype="float32", max_total_tokens=512) as single:
        expected = _ids(single.generate(input_ids=prompts[:4], sampling_params=GREEDY))
    with Engine(str(tmp_path), tp_size=2, dtype="float32", max_total_tokens=512) as parallel:
        assert _ids(parallel.generate(input_ids=prompts[:4], sampling_params=GREEDY)) == expected


# ---- processes: `forklm serve` ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forklm(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "forklm", "serve", *args],
                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_served_default_model_with_openai_client_matches_tp1(make_engine):
    from openai import OpenAI

    port = _free_port()
    proc = _forklm("--port", str(port), "--tp-size", "2", "--dtype", "float32",
                   "--max-total-tokens", "4096", "--log-level", "warning")
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        prompts = EVAL_QUESTIONS[:4]
        completion = client.completions.create(model="default", prompt=prompts, max_tokens=16,
                                               temperature=0)
        served = [c.text for c in sorted(completion.choices, key=lambda c: c.index)]
        expected = make_engine().generate(prompts, {"temperature": 0, "max_new_tokens": 16})
        assert served == [r["text"] for r in expected]
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompts[0]}], max_tokens=8,
            temperature=0)
        assert chat.choices[0].message.content
        proc.send_signal(signal.SIGTERM)  # the server shuts its worker down and exits 0
        assert proc.wait(timeout=30) == 0, proc.stdout.read().decode()
    finally:
        _stop(proc)


def test_two_nodes_serve_and_a_stopped_node_turns_health_red(tmp_path, tokenizer, prompts):
    # One KV head for 2 ranks: both keep a copy of it (the replicated case).
    build_tiny_model("llama3", tmp_path, tokenizer, num_key_value_heads=1)
    tiny_folder = str(tmp_path)
    addr = f"127.0.0.1:{_free_port()}"
    port = _free_port()
    common = ["--model-path", tiny_folder, "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr, "--dtype", "float32", "--max-total-tokens", "512"]
    worker = _forklm(*common, "--node-rank", "1")  # blocks as node 1's rank until node 0 stops
    server = _forklm(*common, "--node-rank", "0", "--port", str(port), "--log-level", "warning")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, base)
        body = {"input_ids": prompts[:4], "sampling_params": GREEDY}
        served = [r["output_ids"] for r in httpx.post(base + "/generate", json=body,
                                                      timeout=60).json()]
        with Engine(tiny_folder, dtype="float32", max_total_tokens=512) as single:
            assert served == _ids(single.generate(input_ids=prompts[:4], sampling_params=GREEDY))
        worker.send_signal(signal.SIGTERM)  # node 1 stops its rank: rank 0's next ping fails
        lost = time.monotonic()
        assert worker.wait(timeout=10) == 143
        while (health := httpx.get(base + "/health", timeout=2)).status_code == 200:
            assert time.monotonic() - lost < 15, "health still green"
            time.sleep(0.2)
        assert "tensor-parallel worker lost" in health.json()["reason"]
        assert httpx.post(base + "/generate", json=body, timeout=10).status_code >= 400
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, server.stdout.read().decode()
    finally:
        _stop(worker, server)
