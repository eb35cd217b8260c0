"""Smoke tests of the benchmark suite: the HTTP runner and server launcher against a tiny fake
OpenAI server, the report, and (slow) W5 programs and the KV memory ratio on the real engine."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
from fake_openai_server import FakeOpenAIHandler, serve

# benchmarks/ is a folder of the repository, not part of the installed package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402
from benchmarks.http_runner import HTTPRunner  # noqa: E402
from benchmarks.servers import ServerProcess, free_port  # noqa: E402
from benchmarks.workloads import multi_turn, shared_prefix  # noqa: E402


@pytest.fixture()
def fake_url():
    FakeOpenAIHandler.bodies = []
    server = serve()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_runner_counts_tokens_cache_and_sends_greedy_ignore_eos(fake_url):
    wl = shared_prefix(num_requests=6)
    wl.max_in_flight = 1  # in order, so the fake's cache (previous prompt) is deterministic
    m = HTTPRunner(fake_url + "/v1", "fake").run(wl)
    assert m.output_tokens_per_s * m.wall_s == pytest.approx(6 * 64)
    assert m.prompt_tokens_sent == sum(len(r.prompt.split()) for r in wl.requests)
    # Every prompt after the first shares the ~400-word prefix with the one before it.
    assert m.prompt_tokens_computed < 0.3 * m.prompt_tokens_sent
    assert 0 < m.median_ttft_s <= m.median_latency_s <= m.p99_latency_s
    assert math.isnan(m.peak_rss_mb)  # no server pid given
    body = FakeOpenAIHandler.bodies[0]
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["stream"] is True
    assert body["max_tokens"] == 64


def test_http_runner_multi_turn_sends_turns_in_order_with_answers(fake_url):
    wl = multi_turn(num_conversations=2, num_turns=3)
    HTTPRunner(fake_url, "fake").run(wl)
    prompts = [b["prompt"] for b in FakeOpenAIHandler.bodies]
    assert len(prompts) == 6
    answer = "".join(f" w{i}" for i in range(64))
    for conv in range(2):
        questions = [r.prompt for r in wl.requests if r.conversation == conv]
        expected = questions[0]
        for turn, question in enumerate(questions):
            if turn:
                expected = expected + answer + "\n" + question
            assert expected in prompts, f"conversation {conv} turn {turn} not sent as expected"


def test_server_process_waits_for_health_and_measures_server_rss():
    script = pathlib.Path(__file__).parent / "fake_openai_server.py"
    port = free_port()
    with ServerProcess([sys.executable, str(script), "--port", str(port)], port,
                       startup_timeout_s=30) as server:
        runner = HTTPRunner(server.base_url, "fake", server_pid=server.pid)
        m = runner.run(shared_prefix(num_requests=2))
        assert m.peak_rss_mb > 5
        pid = server.pid
    assert server.proc is not None and server.proc.poll() is not None, f"pid {pid} still runs"


def test_server_process_reports_a_server_that_exits():
    with pytest.raises(RuntimeError, match="exited with 3"):
        ServerProcess([sys.executable, "-c", "import sys; sys.exit(3)"], free_port(),
                      startup_timeout_s=30).__enter__()


def test_report_table_ratios_and_plot(fake_url, tmp_path):
    wl = shared_prefix(num_requests=2)
    runs: report.Runs = {}
    for system in ("forklm", "hf8"):
        runs[(wl.name, system)] = [HTTPRunner(fake_url, system).run(wl) for _ in range(2)]
    text = report.table(runs)
    assert text.count("| W1 shared prefix |") == 2
    lines = report.ratios(runs, {"KV bytes reserved / needed": (1.0, 1.02)}).splitlines()
    assert any(line.startswith("| W1 forklm / transformers batch 8 |") for line in lines)
    assert "| KV bytes reserved / needed | 1.00x | <= 1.02x | yes |" in lines
    if report.plot(runs, tmp_path / "p.png"):
        assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
def test_w5_programs_batched_and_one_at_a_time(make_engine):
    from benchmarks.programs import LABELS, ProgramRunner, ProgramWorkload, classify, select_items

    runner = ProgramRunner(make_engine(), "forklm")
    pw = ProgramWorkload("W5 select program", classify, select_items(3))
    batched, single = runner.run(pw, batched=True), runner.run(pw, batched=False)
    for m in (batched, single):
        assert m.requests_per_s > 0 and m.prompt_tokens_sent > 0
        # the few-shot prefix is shared by the 4 choices of every run: most of it is cached
        assert m.prompt_tokens_computed < 0.5 * m.prompt_tokens_sent
    states = classify.run_batch(select_items(2), backend=runner.backend, temperature=0.0)
    assert all(s["label"].strip() in LABELS for s in states)


@pytest.mark.slow
def test_kv_memory_ratio_is_one_with_page_size_one(make_engine):
    from benchmarks.kv_memory import measure_kv_memory
    from benchmarks.workloads import no_sharing

    wl = no_sharing(num_requests=4)
    for r in wl.requests:
        r.max_new_tokens = 24
    kv = measure_kv_memory(make_engine(), wl, interval_s=0.01)
    assert kv.bytes_per_slot == kv.bytes_per_token
    assert kv.max_ratio == pytest.approx(1.0)


def test_workload_scaling_keeps_whole_conversations_and_in_flight_override():
    from benchmarks.__main__ import _workload

    wl = _workload("W3", 0.25, None)
    assert {r.conversation for r in wl.requests} == {0, 1, 2, 3}
    assert len(wl.requests) == 16 and wl.max_in_flight == 16
    w1 = _workload("W1-64", 0.5, None)
    assert len(w1.requests) == 32 and w1.max_in_flight == 64
    assert _workload("W2", 1.0, 8).max_in_flight == 8


def test_scale_full_selects_the_full_suite(monkeypatch):
    import benchmarks.__main__ as cli

    monkeypatch.setattr(sys, "argv", ["benchmarks", "--scale", "full", "--repeats", "3"])
    args = cli._parse_args()
    assert args.scale == 1.0 and args.kv_memory and args.repeats == 3
    assert args.workloads == cli.FULL_WORKLOADS and args.systems == cli.FULL_SYSTEMS
    monkeypatch.setattr(sys, "argv", ["benchmarks", "--scale=full", "--systems=forklm"])
    assert cli._parse_args().systems == "forklm"


def test_synthetic_gguf_of_a_shape_loads_kept_quantized_and_generates(tmp_path, monkeypatch):
    """benchmarks/gguf_sizes.py's writer (a small shape here, F16 as written before
    llama-quantize): the file has the shape's tensors and forklm serves it."""
    import gguf

    from benchmarks.gguf_sizes import PROMPT, Shape, _tensors, first_load_s, type_mix, write_f16
    from forklm import Engine

    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    shape = Shape("qwen2", 49408, 128, 256, 2, 4, 2, 1e6, qkv_bias=True)
    path = tmp_path / "small.gguf"
    write_f16(path, shape)
    reader = gguf.GGUFReader(path)
    assert [(t.name, tuple(t.shape.tolist()[::-1])) for t in reader.tensors] == _tensors(shape)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == shape.vocab
    assert type_mix(path).startswith("F16")
    assert first_load_s(path) is not None and first_load_s(path) is None  # then cached
    engine = Engine(model_path=str(path), max_total_tokens=256)
    try:
        out = engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_read_probe_reads_every_word_of_its_buffer(streams: int) -> None:
    # The bandwidth floor's C probe: each thread's part, as `streams` runs, covers every word
    # (its result is the XOR of all it read).
    import functools
    import operator

    import torch

    from benchmarks.bandwidth import _read_probe

    probe = _read_probe()
    if probe is None:
        pytest.skip("no C compiler")
    threads = 2
    words = threads * streams * 16 * 37  # whole 128-byte lines per run: nothing left over
    data = torch.randint(0, 2**62, (words,), dtype=torch.int64)
    expected = functools.reduce(operator.xor, data.tolist())
    assert probe(data.data_ptr(), words, streams, threads) == expected

