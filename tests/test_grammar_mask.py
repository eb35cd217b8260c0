"""Grammar masks on a tiny vocabulary against brute force: after every prefix of random valid walks,
the mask allows exactly the tokens whose text keeps the output a prefix of some string of the
language, and EOS exactly where the output is a complete string."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import regex
import torch
import xgrammar as xgr

from forklm.runtime.sampling.constraints import GrammarBackend
from forklm.runtime.sampling.params import SamplingParams

EOS = 0
# Single characters, multi-character pieces that cross grammar boundaries, a two-byte character,
# and a special token (the empty string) that no grammar may produce.
VOCAB = ["</s>", "a", "b", "c", "ab", "ba", "bc", "1", "2", "5", "0", "12", "25", "255", ".",
         "1.", ".2", "{", "}", '"', '{"', '":', ": ", ", ", '"x', "x", "y", "é", "aé", " ", "(",
         ")", "+", "*", "1+", "", "3", "4"]

REGEX_CASES = [r"[ab]+c?", r"(1[0-9]|2)\.[ab]{1,2}", r"(25[0-5]|2[0-4]\d|[01]?\d\d?)\.(1|25)",
               r"(aé|b)*x"]
# Finite languages, enumerated: constraint -> every string of its language.
FINITE_CASES = [
    ({"choices": ["ab", "abc", "ba", "x.y", "é"]}, ["ab", "abc", "ba", "x.y", "é"]),
    ({"json_schema": {"type": "object", "properties": {"x": {"enum": [1, 12, "ab"]}},
                      "required": ["x"]}},
     ['{"x": 1}', '{"x": 12}', '{"x": "ab"}']),
    ({"ebnf": 'root ::= num | "(" num op num ")"\nop ::= "+" | "*"\nnum ::= [1-3] [0-5]?'},
     (nums := [a + b for a in "123" for b in ["", *"012345"]])
     + [f"({x}{op}{y})" for x in nums for op in "+*" for y in nums]),
]


@pytest.fixture(scope="module")
def backend() -> Iterator[GrammarBackend]:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    backend = GrammarBackend(lambda: info)
    yield backend
    backend.close()


def allowed_by_mask(backend: GrammarBackend, matcher: xgr.GrammarMatcher) -> set[int]:
    """Tokens left finite by the engine's masking path. A second, unconstrained row must come
    out untouched."""
    logits = torch.zeros(2, len(VOCAB))
    backend.mask_logits(logits, [matcher, None])
    assert bool((logits[1] == 0).all()), "an unconstrained row was masked"
    return {t for t in range(len(VOCAB)) if logits[0, t] == 0}


def walk_and_check(backend, constraint: dict, is_prefix, is_complete, seed: int) -> None:
    compiled = backend.compile(SamplingParams(**constraint).constraint).result()
    matcher = xgr.GrammarMatcher(compiled)
    rng = random.Random(seed)
    text = ""
    for _ in range(24):
        expected = {t for t, piece in enumerate(VOCAB) if piece and is_prefix(text + piece)}
        if is_complete(text):
            expected.add(EOS)
        assert allowed_by_mask(backend, matcher) == expected, f"after {text!r}"
        if not expected:
            raise AssertionError(f"dead end after {text!r}")
        # Prefer continuing, so that walks reach deep states, but end sometimes.
        choices = sorted(expected - {EOS}) or [EOS]
        token = EOS if EOS in expected and rng.random() < 0.2 else rng.choice(choices)
        assert matcher.accept_token(token)
        if token == EOS:
            assert matcher.is_terminated()
            return
        text += VOCAB[token]


@pytest.mark.parametrize("pattern", REGEX_CASES)
def test_regex_mask_matches_brute_force(backend, pattern):
    for seed in range(12):
        walk_and_check(backend, {"regex": pattern},
                       lambda s: regex.fullmatch(pattern, s, partial=True) is not None,
                       lambda s: regex.fullmatch(pattern, s) is not None, seed)


@pytest.mark.parametrize("constraint, language", FINITE_CASES, ids=["choices", "json", "ebnf"])
def test_finite_language_mask_matches_brute_force(backend, constraint, language):
    assert len(set(language)) == len(language) > 1
    for seed in range(12):
        walk_and_check(backend, constraint, lambda s: any(w.startswith(s) for w in language),
                       lambda s: s in language, seed)


def test_choices_with_quotes_and_escapes(backend):
    choices = ['a"b', "a\\b", "x\ny", "é"]
    constraint = SamplingParams(choices=choices).constraint
    assert constraint is not None and json.loads(constraint.spec) == choices
    grammar = backend.compile(constraint).result()
    for choice in choices:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice


def test_bitmask_buffer_is_reused(backend):
    matcher = xgr.GrammarMatcher(backend.compile(SamplingParams(regex="a+").constraint).result())
    logits = torch.zeros(3, len(VOCAB))
    backend.mask_logits(logits, [None, matcher, matcher])
    buffer = backend._bitmask
    backend.mask_logits(torch.zeros(2, len(VOCAB)), [matcher, None])  # a smaller batch
    assert backend._bitmask is buffer
    assert bool((logits[0] == 0).all())
    assert {t for t in range(len(VOCAB)) if logits[1, t] == 0} == {VOCAB.index("a")}
