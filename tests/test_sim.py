"""The simulator (forklm/sim): its accounting is the real engine's, its clock and percentiles add
up by hand, the cost model fit recovers known coefficients, and bad input is refused by name."""

from __future__ import annotations

import json
import random

import pytest

from forklm.runtime.config import EngineConfig
from forklm.runtime.engine.engine import Engine
from forklm.sim.cost_model import CostModel, StepShape, TimedStep, fit_forward, fit_overhead
from forklm.sim.report import percentile
from forklm.sim.simulator import ModelFacts, SimConfig, Simulation
from forklm.sim.traces import AgentTraceConfig, Session, Trace, Turn, agent_trace
from tests.tiny_models import build_tiny_model

# A step costs a constant per phase: hand-computable timelines.
FLAT = CostModel(prefill_base_s=0.5, prefill_per_token_s=0.0, prefill_per_pair_s=0.0,
                 decode_base_s=0.1, decode_per_req_s=0.0, decode_per_context_s=0.0)
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone".split()


@pytest.fixture(scope="module")
def facts(default_model) -> ModelFacts:
    return ModelFacts(default_model.tokenizer, frozenset(default_model.eos_token_ids), 49152, 8192)


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def one_turn(prompts: list[str], max_new_tokens: int, gap_s: float = 0.0,
             max_in_flight: int | None = None) -> Trace:
    return Trace("t", tuple(Session(i * gap_s, (Turn(p, max_new_tokens),))
                            for i, p in enumerate(prompts)), max_in_flight)


def test_accounting_matches_the_real_engine(tmp_path, tokenizer):
    """Same requests, same engine config: the simulated replica computes and caches exactly the
    prompt tokens the real engine does, in the same number of steps (its scheduler, radix cache
    and KV pool are the real ones; a KV pool this small forces evictions and retractions)."""
    build_tiny_model("llama3", tmp_path, tokenizer, max_position_embeddings=2048)
    rng = random.Random(0)
    prefixes = [sentence(rng, 60) for _ in range(2)]
    prompts = [rng.choice(prefixes) + " Q: " + sentence(rng, rng.randint(3, 12)) for _ in range(14)]
    config = {"max_total_tokens": 900, "max_running_requests": 6, "chunked_prefill_size": 64,
              "max_prefill_tokens": 256}
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(model_path=str(tmp_path), dtype="float32", debug_check_invariants=True,
                **config) as engine:
        engine.generate(prompts, params)
        real = engine.stats()
    sim = Simulation(SimConfig(1, "round_robin", EngineConfig(**config), check_invariants=True),
                     FLAT, ModelFacts.load(str(tmp_path)))
    summary = sim.run(one_turn(prompts, 24)).summary()
    assert real["cache_hit_tokens"] > 0
    assert summary.prompt_tokens_sent == real["prompt_tokens"]
    assert summary.prompt_tokens_sent - summary.prompt_tokens_computed == real["cache_hit_tokens"]
    assert sim.replicas[0].stats.steps == real["steps"]


def test_virtual_clock_by_hand(facts):
    """One replica, 0.5 s prefill and 0.1 s decode steps, a gate of one request in flight: the
    second request is sent when the first finishes; a session's second turn after its delay."""
    trace = Trace("t", (Session(0.0, (Turn("one two three", 3), Turn(" four", 2, delay_s=1.0))),
                        Session(0.0, (Turn("five six", 3),))), max_in_flight=1)
    records = Simulation(SimConfig(1, "round_robin"), FLAT, facts).run(trace).records
    by_key = {(r.session, r.turn): r for r in records}
    first, other, second_turn = by_key[0, 0], by_key[1, 0], by_key[0, 1]
    # prefill 0 -> 0.5 (token 1), decodes to 0.6 and 0.7 (tokens 2, 3)
    assert (first.first_token_s, first.finish_s) == pytest.approx((0.5, 0.7))
    assert first.tpot_s == pytest.approx(0.1)
    assert (other.sent_s, other.ttft_s, other.finish_s) == pytest.approx((0.7, 0.5, 1.4))
    # turn 2 arrives at 0.7 + 1.0 but waits for the gate (other finishes at 1.4): sent at 1.7
    assert (second_turn.sent_s, second_turn.finish_s) == pytest.approx((1.7, 2.3))
    assert second_turn.cached_tokens > first.prompt_tokens // 2  # its history was cached
    assert second_turn.prompt_tokens > first.prompt_tokens + 2


def test_percentiles_and_summary_by_hand(facts):
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)
    # Four requests 10 s apart, each alone: TTFT 0.5 s, TPOT 100 ms, 4 tokens each.
    summary = Simulation(SimConfig(1), FLAT, facts).run(
        one_turn(["a b c", "d e f", "g h i", "j k l"], 4, gap_s=10.0)).summary()
    assert summary.ttft_s == pytest.approx((0.5, 0.5, 0.5))
    assert summary.tpot_ms == pytest.approx((100.0, 100.0, 100.0))
    assert summary.wall_s == pytest.approx(30.8)
    assert summary.output_tokens_per_s == pytest.approx(16 / 30.8)


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes(facts):
    rng = random.Random(1)
    families = [sentence(rng, 80) for _ in range(4)]
    prompts = [rng.choice(families) + " Q: " + sentence(rng, 6) for _ in range(32)]
    trace = one_turn(prompts, 4, gap_s=0.05)
    hit = {policy: Simulation(SimConfig(4, policy, check_invariants=True), FLAT, facts)
           .run(trace).summary().cache_hit_rate for policy in ("round_robin", "cache_aware")}
    assert hit["cache_aware"] > hit["round_robin"] + 0.1, hit


def test_agent_trace_grows_context_and_replays(facts):
    config = AgentTraceConfig(num_sessions=6, sessions_per_s=2.0, system_prompt_words=50,
                              min_turns=3, max_turns=3, max_new_tokens=8)
    trace = agent_trace(config)
    assert trace.num_requests == 18 and trace.sessions[1].start_s > trace.sessions[0].start_s
    result = Simulation(SimConfig(2, "cache_aware", check_invariants=True), FLAT, facts).run(trace)
    turns = sorted((r for r in result.records if r.session == 0), key=lambda r: r.turn)
    assert [r.turn for r in turns] == [0, 1, 2]
    assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
    assert all(r.output_tokens == 8 and r.finish_reason == "length" for r in result.records)
    assert result.summary().cache_hit_rate > 0.3


def test_request_the_kv_cannot_hold_is_aborted_and_the_trace_goes_on(facts):
    """Past the KV pool, the real scheduler gives up on a request (abort); the client's gate
    frees its place and the next request is served."""
    engine = EngineConfig(max_total_tokens=48, max_running_requests=4)
    trace = Trace("t", (Session(0.0, (Turn(" ".join(WORDS * 2), 40),)),
                        Session(0.0, (Turn("a b c", 4),))), max_in_flight=1)
    records = Simulation(SimConfig(1, "round_robin", engine, check_invariants=True), FLAT,
                         facts).run(trace).records
    assert [(r.session, r.finish_reason) for r in records] == [(0, "abort"), (1, "length")]
    assert records[1].sent_s == records[0].finish_s


def test_cost_fit_recovers_known_coefficients():
    truth = CostModel(0.02, 1e-4, 2e-8, 0.01, 5e-4, 3e-6)
    rng = random.Random(0)
    shapes = [StepShape(False, 1, n, n + p, n * p + n * (n + 1) // 2)
              for n in (16, 64, 256, 1024) for p in (0, 300, 900)]
    shapes += [StepShape(True, b, b, b * c, b * c) for b in (1, 4, 16, 32) for c in (100, 800)]
    samples = [TimedStep(s, truth.forward_s(s) * rng.uniform(0.99, 1.01)) for s in shapes]
    fitted = fit_forward(samples)
    for name in ("prefill_base_s", "prefill_per_token_s", "prefill_per_pair_s", "decode_base_s",
                 "decode_per_req_s", "decode_per_context_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    o0, o1 = fit_overhead([(100, 100, 100 * 0.003 + 100 * 0.0005),
                           (50, 400, 50 * 0.003 + 400 * 0.0005)])
    assert (o0, o1) == pytest.approx((0.003, 0.0005))


def test_cost_model_round_trips_and_refuses_bad_input(tmp_path):
    path = tmp_path / "cost.json"
    FLAT.to_json(path)
    assert CostModel.from_json(path) == FLAT
    given = CostModel.from_spec("decode_base_s=0.01, decode_per_req_s=0.0002")
    assert given.decode_per_req_s == 0.0002 and given.prefill_base_s == 0.0
    bad = {"file": "{not json", "negative": json.dumps({**json.loads(path.read_text()),
                                                         "decode_base_s": -1}),
           "unknown": json.dumps({**json.loads(path.read_text()), "warp": 1})}
    expected = {"file": "cost.json", "negative": "decode_base_s", "unknown": "warp"}
    for case, text in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=expected[case]):
            CostModel.from_json(path)
    with pytest.raises(ValueError, match="unknown coefficient 'speed'"):
        CostModel.from_spec("speed=3")


def test_cli_refuses_bad_arguments_by_name(capsys, tmp_path):
    from forklm.sim.__main__ import main, parse_args

    for argv, name in ((["--replicas", "0"], "--replicas"), (["--policies", "best"], "--policies")):
        with pytest.raises(SystemExit):
            parse_args([*argv, "--cost", "decode_base_s=0.01"])
        assert name in capsys.readouterr().err
    FLAT.to_json(tmp_path / "bad.json")
    data = json.loads((tmp_path / "bad.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps({**data, "decode_base_s": "fast"}))
    with pytest.raises(SystemExit, match="bad.json.*decode_base_s"):
        main(["--cost-file", str(tmp_path / "bad.json")])


def test_bad_simulation_config_is_refused_by_name():
    with pytest.raises(ValueError, match="num_replicas=0"):
        SimConfig(num_replicas=0)
    with pytest.raises(ValueError, match="policy='fastest'.*round_robin, shortest_queue, cache_aware"):
        SimConfig(num_replicas=2, policy="fastest")
    with pytest.raises(ValueError, match="max_total_tokens"):
        SimConfig(engine=EngineConfig())
    with pytest.raises(ValueError, match="step_jitter=1.5"):
        SimConfig(step_jitter=1.5)
    with pytest.raises(ValueError, match="max_in_flight=0"):
        Trace("t", (Session(0.0, (Turn("x"),)),), max_in_flight=0)
    with pytest.raises(ValueError, match="sessions_per_s"):
        AgentTraceConfig(sessions_per_s=0)
