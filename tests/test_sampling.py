"""SamplingParams validation and the batched sampler against plain-loop references."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling import sampler
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.sampling.sampler import apply_penalties, sample


@dataclass
class Row:
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    min_tokens_stop_ids: list[int] = field(default_factory=list)
    top_logprobs_num: int = 0


def seeded(seed: int, **params) -> Row:
    return Row(SamplingParams(**params), torch.Generator().manual_seed(seed))


# ---- SamplingParams ----

@pytest.mark.parametrize("name, value", [
    ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("min_new_tokens", -1), ("temperature", -0.1), ("temperature", math.nan),
    ("temperature", "1"), ("top_p", 0), ("top_p", 1.5), ("top_k", 0), ("top_k", -2),
    ("top_k", 2.0), ("min_p", 1.5), ("frequency_penalty", 2.5), ("presence_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("stop", ""), ("stop", ["a", ""]),
    ("stop", 5), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("ignore_eos", 1),
    ("n", 0), ("seed", -1), ("seed", 1.0),
])
def test_bad_value_names_the_field(name, value):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**{name: value})
    assert e.value.name == name and isinstance(e.value, ValueError)
    assert name in str(e.value)


def test_min_new_tokens_cannot_exceed_max_new_tokens():
    with pytest.raises(InvalidArgumentError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=3)


def test_defaults_and_normalization():
    p = SamplingParams(stop="x", stop_token_ids=(3, 4), temperature=1)
    assert p.stop == ["x"] and p.stop_token_ids == [3, 4]
    assert isinstance(p.temperature, float) and p.max_new_tokens == 128 and p.top_k == -1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop is None and not SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy


def test_from_dict_rejects_unknown_keys_listing_known_ones():
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams.from_dict({"temprature": 0.5})
    assert e.value.name == "temprature" and "temperature" in str(e.value)


def test_sampling_seed_alias():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"seed": 7, "sampling_seed": 7}).seed == 7
    with pytest.raises(InvalidArgumentError):
        SamplingParams.from_dict({"seed": 7, "sampling_seed": 8})


def test_coerce():
    p = SamplingParams(top_k=5)
    assert SamplingParams.coerce(p) is p
    assert SamplingParams.coerce(None) == SamplingParams()
    assert SamplingParams.coerce({"top_k": 5}) == p
    with pytest.raises(InvalidArgumentError):
        SamplingParams.coerce(5)


# ---- sampler ----

def test_greedy_and_top_k_1_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [Row(SamplingParams(temperature=0))] * 3 + [seeded(i, top_k=1, temperature=1.3)
                                                        for i in range(3)]
    result = sample(logits.clone(), rows)
    assert result.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values  # greedy rows: no temperature
    torch.testing.assert_close(torch.tensor(result.logprobs), expected)


def draw(seed: int, steps: int = 20, **params) -> list[int]:
    logits = torch.zeros(1, 100)  # uniform: any two seeds almost surely differ
    row = seeded(seed, **params)
    return [sample(logits.clone(), [row]).token_ids[0] for _ in range(steps)]


def test_same_seed_same_samples_different_seeds_differ():
    assert draw(1) == draw(1)
    assert draw(1, top_p=0.5) == draw(1, top_p=0.5)
    assert draw(1) != draw(2)


def test_a_rows_sample_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 300) * 2
    for params in [{}, {"top_p": 0.8}, {"top_k": 20, "min_p": 0.05}, {"min_p": 0.1}]:
        row = seeded(5, **params)
        alone = [sample(logits.clone(), [row]).token_ids[0] for _ in range(8)]
        for pos in range(5):
            row = seeded(5, **params)
            neighbours = [Row(SamplingParams(temperature=0)), seeded(pos, top_p=0.3),
                          seeded(11, repetition_penalty=1.5, top_k=3), seeded(13)]
            neighbours[2].output_ids = [1, 2, 2]
            rows = neighbours[:pos] + [row] + neighbours[pos:]
            in_batch = []
            for _ in range(8):
                batch = torch.cat([torch.randn(pos, 300), logits, torch.randn(4 - pos, 300)])
                in_batch.append(sample(batch, rows).token_ids[pos])
            assert in_batch == alone, (params, pos)


def test_tied_logits_sample_the_same_token_alone_and_beside_a_wider_row():
    """Logits rounded to bf16 tie often; topk orders tied candidates differently for another k,
    so before candidates were ordered by token id among equals, a neighbour that widened the
    candidate set changed which token a row's uniform picked (test_deterministic's seeded
    EOS-or-newline draw)."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 4096, generator=gen) * 3).bfloat16().float()
    flat = torch.zeros(1, 4096)  # top_p=0.95 of a flat row widens the candidates past 64
    for seed in range(60):
        alone = sample(logits.clone(), [seeded(seed, top_p=0.95)]).token_ids[0]
        rows = [seeded(seed, top_p=0.95), seeded(99, top_p=0.95)]
        beside = sample(torch.cat([logits, flat]), rows).token_ids[0]
        assert alone == beside, seed


def test_min_new_tokens_blocks_stop_ids():
    logits = torch.zeros(2, 10)
    logits[:, 2] = 100.0  # EOS would win every time
    params = SamplingParams(temperature=0, min_new_tokens=3)
    early = Row(params, output_ids=[5], min_tokens_stop_ids=[2, 7])
    late = Row(params, output_ids=[5, 5, 5], min_tokens_stop_ids=[2, 7])
    assert sample(logits.clone(), [early, late]).token_ids == [0, 2]
    sampled = Row(SamplingParams(min_new_tokens=3), torch.Generator().manual_seed(0),
                  min_tokens_stop_ids=[2])
    assert all(sample(logits[:1].clone(), [sampled]).token_ids[0] != 2 for _ in range(50))


def penalties_ref(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    out = logits.clone()
    for b, row in enumerate(rows):
        p = row.sampling_params
        for t in set(row.origin_input_ids + row.output_ids):
            x = out[b, t].item()
            out[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(row.output_ids):
            out[b, t] -= p.frequency_penalty * row.output_ids.count(t) + p.presence_penalty
    return out


def test_penalties_small_hand_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [Row(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                               presence_penalty=0.25), origin_input_ids=[0], output_ids=[1, 1]),
            Row()]
    out = logits.clone()
    apply_penalties(out, rows)
    # token 0: prompt only -> 2/2; token 1: -1*2 - 0.5*2 - 0.25; others untouched.
    assert out.tolist() == [[1.0, -3.25, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]]


ids = st.lists(st.integers(0, 11), max_size=8)
penalty_params = st.builds(
    SamplingParams, repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    frequency_penalty=st.sampled_from([0.0, -1.5, 0.7]),
    presence_penalty=st.sampled_from([0.0, 2.0, -0.4]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(penalty_params, ids, ids), min_size=1, max_size=4), st.integers(0, 99))
def test_penalties_match_plain_loop(specs, seed):
    rows = [Row(p, origin_input_ids=prompt, output_ids=out) for p, prompt, out in specs]
    logits = torch.randn(len(rows), 12, generator=torch.Generator().manual_seed(seed)) * 3
    out = logits.clone()
    apply_penalties(out, rows)
    torch.testing.assert_close(out, penalties_ref(logits, rows))


def allowed_ref(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens top-k, then top-p (on the renormalized top-k set), then min-p keep; a plain loop."""
    probs = torch.softmax(logits / p.temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if p.top_k > 0:
        order = order[: p.top_k]
    mass, total, kept = 0.0, sum(probs[t] for t in order), []
    for t in order:
        if mass >= p.top_p * total:
            break
        kept.append(t)
        mass += probs[t]
    return {t for t in kept if probs[t] >= p.min_p * probs[order[0]]}


@pytest.mark.parametrize("params", [
    {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.3}, {"top_k": 5, "top_p": 0.7},
    {"top_k": 6, "min_p": 0.2, "temperature": 0.7}, {"top_p": 0.9, "min_p": 0.1},
])
def test_truncation_never_samples_outside_the_allowed_set(params):
    logits = torch.tensor([[3.0, 2.5, 2.4, 1.0, 0.5, 0.0, -1.0, -2.0]])
    p = SamplingParams(**params)
    allowed = allowed_ref(logits[0], p)
    num_draws = 2000
    rows = [Row(p, torch.Generator().manual_seed(i)) for i in range(num_draws)]
    drawn = sample(logits.expand(num_draws, -1).clone(), rows).token_ids
    counts = torch.bincount(torch.tensor(drawn), minlength=8)
    assert set(drawn) == allowed, (set(drawn), allowed)
    # Frequencies follow the renormalized probabilities (6 sigma of a binomial).
    probs = torch.softmax(logits[0] / p.temperature, -1)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[list(allowed)] = True
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    sigma = (expected * (1 - expected) * num_draws).sqrt()
    assert ((counts - expected * num_draws).abs() <= 6 * sigma + 1).all()


def test_top_p_wider_than_first_candidate_batch():
    # Flat distribution: top_p=0.9 needs ~180 of 200 tokens, more than the first 64 candidates.
    logits = torch.linspace(0.0, 0.5, 200)[None]
    p = SamplingParams(top_p=0.9)
    rows = [Row(p, torch.Generator().manual_seed(i)) for i in range(3000)]
    drawn = set(sample(logits.expand(3000, -1).clone(), rows).token_ids)
    allowed = allowed_ref(logits[0], p)
    assert drawn <= allowed and len(allowed) > sampler._MIN_CANDIDATES
    assert min(drawn) < 200 - sampler._MIN_CANDIDATES


def test_inverse_cdf_never_lands_on_zero_weight():
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    u = torch.tensor([1.0, 1.0])  # worst case: u * total == total
    assert sampler._inverse_cdf(weights, u).tolist() == [1, 1]


def test_logprobs_are_log_softmax_after_temperature_and_top_logprobs_sorted():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    temps = [0.5, 1.0, 2.0, 0.0]
    rows = [seeded(i, temperature=t, top_p=0.9) for i, t in enumerate(temps)]
    for row, num in zip(rows, [3, 0, 5, 2], strict=True):
        row.top_logprobs_num = num
    result = sample(logits.clone(), rows)
    for b, (t, row) in enumerate(zip(temps, rows, strict=True)):
        ref = torch.log_softmax(logits[b] / (t or 1.0), -1)
        assert result.logprobs[b] == pytest.approx(ref[result.token_ids[b]].item(), abs=1e-5)
        top = result.top_logprobs[b]
        assert len(top) == row.top_logprobs_num
        assert [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)
        for value, token in top:
            assert value == pytest.approx(ref[token].item(), abs=1e-5)
        if top:
            assert top[0][1] == ref.argmax().item()


# ---- logit_bias ----

def test_logit_bias_is_added_per_row_in_one_batch():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    rows = [Row(SamplingParams(temperature=0, logit_bias={"7": 6.0})),
            Row(SamplingParams(temperature=0, logit_bias={4: -100, 1: 2.0})),
            Row(SamplingParams(temperature=0))]
    result = sample(logits.clone(), rows)
    assert result.token_ids == [7, 1, 4]
    # The logprobs are of the biased distribution, as what is sampled from.
    biased = logits[0].clone()
    biased[7] += 6.0
    assert result.logprobs[0] == pytest.approx(float(torch.log_softmax(biased, -1)[7]))
    ban = Row(SamplingParams(logit_bias={4: -100.0}), torch.Generator().manual_seed(0))
    assert all(sample(logits[:1].clone(), [ban]).token_ids[0] != 4 for _ in range(50))


@pytest.mark.parametrize("bias", [{"7": 101}, {"-1": 1.0}, {"x": 1.0}, {True: 1.0}, {"7": "1"},
                                  {"7": math.inf}, [1, 2], {"1" * 5000: 1.0}])
def test_bad_logit_bias_names_the_field(bias):
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_min_new_tokens_lets_a_row_stop_when_nothing_else_is_allowed():
    """A complete grammar may allow only EOS: that row stops; its neighbours keep the ban."""
    logits = torch.full((2, 10), float("-inf"))
    logits[0, 2] = 0.0  # the grammar's mask left only EOS
    logits[1, 2], logits[1, 5] = 50.0, 0.0
    params = SamplingParams(temperature=0, min_new_tokens=4, ignore_eos=True)
    rows = [Row(params, min_tokens_stop_ids=[2]), Row(params, min_tokens_stop_ids=[2])]
    assert sample(logits, rows).token_ids == [2, 5]


# ---- the native greedy pick ----

@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 300), spread=st.sampled_from([0.01, 1.0, 50.0]),
       bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_native_greedy_pick_is_torch_argmax(rows, vocab, spread, bf16, seed):
    """First index of the max, ties included (a small spread rounds many values equal in bf16),
    for every vocab size around the kernel's 64-value steps."""
    from forklm.kernels.cpu import bindings as native_kernels

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * spread).round()
    logits = logits.bfloat16() if bf16 else logits
    ids = native_kernels.greedy_pick(logits)
    if ids is None:
        pytest.skip("native greedy pick did not build here")
    assert torch.equal(ids, logits.argmax(dim=-1))


def test_native_greedy_pick_nan_inf_and_strided_rows():
    from forklm.kernels.cpu import bindings as native_kernels

    logits = torch.randn(4, 200)
    logits[0, 150] = math.nan  # torch.argmax: the first NaN
    logits[1] = -math.inf  # nothing above -inf: index 0
    logits[2, 70] = logits[2, 130] = 1e9  # tie: the first
    wide = torch.zeros(4, 256)
    wide[:, :200] = logits
    for x in (logits, logits.bfloat16(), wide[:, :200]):
        ids = native_kernels.greedy_pick(x)
        if ids is None:
            pytest.skip("native greedy pick did not build here")
        assert ids.tolist() == x.argmax(dim=-1).tolist()
    assert native_kernels.greedy_pick(logits.t()) is None  # rows not contiguous: not taken


def test_greedy_rows_pick_as_the_general_path(monkeypatch):
    """The native fast path (every row greedy and unedited) and the general path agree on ids
    and, when asked, on bit-equal chosen logprobs; an edited row (a penalty) takes the general
    path."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=gen).bfloat16()
    rows = [Row(SamplingParams(temperature=0)) for _ in range(6)]
    fast = sampler.sample_on_device(logits.clone(), rows)
    fast_no_logprobs = sampler.sample_on_device(logits.clone(), rows, chosen_logprobs=False)
    monkeypatch.setattr(sampler.native_kernels, "greedy_pick", lambda logits: None)
    general = sampler.sample_on_device(logits.clone(), rows)
    assert torch.equal(fast.token_ids, general.token_ids)
    assert torch.equal(fast_no_logprobs.token_ids, general.token_ids)
    assert torch.equal(fast.logprobs, general.logprobs)
    monkeypatch.undo()
    called = []
    monkeypatch.setattr(sampler.native_kernels, "greedy_pick",
                        lambda logits: called.append(1))
    rows[0] = Row(SamplingParams(temperature=0, repetition_penalty=1.3), output_ids=[5])
    sampler.sample_on_device(logits.clone(), rows)
    assert not called
