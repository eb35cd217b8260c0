"""The tokenizer forklm builds from a GGUF's own metadata encodes as the tokenizer the vocabulary
came from: the default model's byte-level BPE, byte-level BPEs trained here under llama.cpp's
`qwen2`, `llama-bpe`, `gpt-2`, `bloom` and `gpt-4o` (gpt-oss's o200k) pre-tokenizer names, and
sentencepiece-style vocabularies (BPE with byte fallback, written as llama.cpp's `llama` model with
scores and byte tokens). BOS, EOS and the chat template follow the GGUF as llama.cpp reads it; the
cached reload is checked alike. When written, llama.cpp's own llama_tokenize (vocab_only) gave these
ids on all of these files but the `bloom` one (added later, without a llama.cpp build at hand:
checked against the split of BLOOM's tokenizer.json, which llama.cpp's `bloom` regex restates)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import gguf
import pytest
import transformers
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from forklm.runtime.models import gguf_loader
from forklm.runtime.models.gguf_file import GGUFFile
from forklm.runtime.models.gguf_loader import END_OF_GENERATION_TEXTS, GGUFModel
from forklm.runtime.models.loader import load_model
from forklm.runtime.models.source import default_model_gguf

MULTILINGUAL = (
    "Hello world! The quick brown fox doesn't jump; it's lazy.\n"
    "Grüße aus München: Über die Straße, schöne Bäume.\n"
    "你好，世界。今天天气很好。\n"
    "日本語のテキストです。カタカナとひらがな。\n"
    "Привет, мир! Как дела?\n"
    "مرحبا بالعالم، كيف حالك؟\n"
    "Emoji: 🎉👍🏽 ❤️ 🇩🇪 done."
)
CODE = (
    "def fib(n: int) -> int:\n"
    "    if n < 2:\n"
    "        return n  # base case\n"
    "\treturn fib(n - 1) + fib(n - 2)\n"
    "\n\n"
    "x  =   1234567 + 89.5e-3   \n"
    "    print(f'{x:>10}', \"ok\")\r\n"
    "  \t  trailing spaces   "
)
SAMPLES = {
    "multilingual": MULTILINGUAL, "code": CODE, "leading_space": "  two spaces, then text",
    "one_word": "Straße", "spaces_only": "   ", "newlines": "\n\n a\r\n\r\nb  \n",
    "numbers": "a1b22c333 4444 55555 ６７ ½ ²", "contractions": "I'M you'RE they'll don't 's",
    "spaced_punctuation": "Hello , world . ok ? ' quoted ' end !",
    "decomposed": "Cafe\u0301 und Gru\u0308sse",  # NFD: llama.cpp does not normalize
    "invisible": "\u00ad\u200b\ufeffzero\u2028x",
}
# Training text: the samples' languages and code in other sentences, so merges form in each but
# the samples are not learned whole.
CORPUS = [
    "The weather in Berlin is nice today and the children play in the park.",
    "Die Katze schläft auf dem Sofa, während der Hund draußen bellt. Größe, Fuß, Öl.",
    "我们明天去北京看朋友，然后回家吃饭。世界很大。",
    "東京は日本の首都です。ひらがなとカタカナを勉強します。",
    "Москва — столица России. Мир большой, дела хорошие.",
    "العالم كبير والناس طيبون. كيف حالك اليوم؟",
    "for i in range(10):\n    total += i * 2\n    if total > 100:\n        break\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 3
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2_CHAT = ("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
               "{% endfor %}")

# Pre-tokenizer regexes as the original tokenizer.json files state them.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BLOOM_SPLIT = " ?[^(\\s|[.,!?…。，、।۔،])]+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (gpt-oss): words split at case changes, contractions kept on their word, "/" after
# punctuation runs
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
WHOLE_WORD = " Bäume"
BYTE_SPELLING = bytes_to_unicode()  # byte -> the character a byte-level vocabulary writes
SPACE = "\u2581"  # sentencepiece's visible space
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]

# token types in a GGUF vocabulary (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


@dataclass
class Vocab:
    """A vocabulary as its original tokenizer encodes it, and the GGUF metadata that carries it."""

    name: str
    original: Tokenizer  # the ground truth, with BOS/EOS as its model adds them
    arch: str
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    bos_id: int
    eos_id: int
    add_bos: bool | None  # tokenizer.ggml.add_bos_token; None: the key is absent
    chat_template: str | None
    scores: list[float] | None = None
    types: list[int] | None = None
    unk_id: int | None = None
    add_space_prefix: bool | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    path: pathlib.Path | None = None  # a GGUF that already holds it (else written from `original`)


# ---- Vocabularies -----------------------------------------------------------------------------


def _train(tokenizer: Tokenizer, vocab_size: int, specials: list[str]) -> tuple[dict, list]:
    """(vocab, merges) of a BPE trained on CORPUS through `tokenizer`'s normalizer and
    pre-tokenizer; `specials` take the first ids."""
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
                                  if isinstance(tokenizer.decoder, decoders.ByteLevel) else [])
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                            for m in model["merges"]]


def _byte_level(split: str | None, specials: list[str], bos: str | None,
                whole_word: str | None) -> Tokenizer:
    """A byte-level BPE trained here; `split`: the pre-tokenizer regex (None: GPT-2's own);
    `whole_word`: added to the vocabulary without a merge, and words looked up before merging
    (tokenizers' ignore_merges, llama.cpp's for llama-bpe), so only that lookup finds it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                               use_regex=False)]))
    tokenizer.decoder = decoders.ByteLevel()
    vocab, merges = _train(tokenizer, 700, specials)
    if whole_word is not None:
        assert len(tokenizer.encode(whole_word).ids) > 1  # the merges do not make it
        vocab["".join(BYTE_SPELLING[b] for b in whole_word.encode())] = len(vocab)
    tokenizer.model = models.BPE(vocab, merges, ignore_merges=whole_word is not None)
    tokenizer.add_special_tokens(specials)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return tokenizer


def _byte_level_vocab(name: str, pre: str, split: str | None, add_bos: bool | None,
                      bos: bool, arch: str | None = None) -> Vocab:
    """A byte-level BPE under llama.cpp's `pre` name; `bos`: llama.cpp adds BOS to it."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eom_id|>"]
    llama3 = pre == "llama-bpe"
    original = _byte_level(split, specials, specials[0] if bos else None,
                           WHOLE_WORD if llama3 else None)
    arch = arch or (pre if pre in ("qwen2", "bloom") else "llama")
    return Vocab(name, original, arch=arch, model="gpt2",
                 pre=pre, bos_id=0, eos_id=2, eot_id=2, eom_id=3 if llama3 else None,
                 add_bos=add_bos, chat_template=CHATML)


def _sentencepiece_vocab(name: str, arch: str, add_space_prefix: bool | None,
                         add_bos: bool | None) -> Vocab:
    """A BPE with byte fallback in sentencepiece's form (Llama 2, Gemma): text with spaces as
    "▁", a "▁" in front when the GGUF says add_space_prefix (llama.cpp's default), no pre-split."""
    specials = ["<unk>", "<s>", "</s>"]
    spaces = normalizers.Replace(" ", SPACE)
    prefix = add_space_prefix is not False
    trainee = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainee.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
    trainee.pre_tokenizer = pre_tokenizers.Split(SPACE, "merged_with_next")
    vocab, merges = _train(trainee, 900, specials + BYTE_PIECES)
    original = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                    fuse_unk=True))
    original.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix \
        else spaces
    original.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    original.add_special_tokens(specials)
    if add_bos is not False:  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        original.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tokens = sorted(vocab, key=vocab.get)
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(tokens) - 259)
    # sentencepiece's BPE scores: a later merge scores lower; llama.cpp merges best-first.
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return Vocab(name, original, arch=arch, model="llama", pre=None, bos_id=1, eos_id=2,
                 add_bos=add_bos, chat_template=LLAMA2_CHAT, scores=scores, types=types,
                 unk_id=0, add_space_prefix=add_space_prefix)


def _default_model_vocab() -> Vocab:
    """The default model's GGUF vocabulary, with SmolLM2's own pre-tokenizer (digits alone,
    then GPT-2's split): llama.cpp's `smollm`."""
    fields = GGUFFile(default_model_gguf()).fields
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    original = Tokenizer(models.BPE(vocab, merges))
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    original.decoder = decoders.ByteLevel()
    original.add_special_tokens([t for t, kind in zip(tokens, fields["tokenizer.ggml.token_type"])
                                 if kind == CONTROL])
    return Vocab("smollm2", original, arch="llama", model="gpt2", pre="smollm",
                 bos_id=fields["tokenizer.ggml.bos_token_id"],
                 eos_id=fields["tokenizer.ggml.eos_token_id"],
                 add_bos=fields["tokenizer.ggml.add_bos_token"],
                 chat_template=fields["tokenizer.chat_template"], path=default_model_gguf())


def write_gguf(path: pathlib.Path, vocab: Vocab, name: str | None = None) -> pathlib.Path:
    """`vocab` as llama.cpp's converter writes a tokenizer, in a GGUF with a tiny model's sizes
    and no tensors (the tokenizer and config need none); `name`: general.name."""
    writer = gguf.GGUFWriter(path, vocab.arch)
    if name is not None:
        writer.add_name(name)
    for add, size in [(writer.add_block_count, 1), (writer.add_context_length, 256),
                      (writer.add_embedding_length, 64), (writer.add_feed_forward_length, 128),
                      (writer.add_head_count, 2), (writer.add_head_count_kv, 2)]:
        add(size)
    model = json.loads(vocab.original.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    specials = {t.content for t in vocab.original.get_added_tokens_decoder().values()}
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(vocab.types or [CONTROL if t in specials else NORMAL for t in tokens])
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.model == "gpt2":
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                                 for m in model["merges"]])
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    if vocab.unk_id is not None:
        writer.add_unk_token_id(vocab.unk_id)
    if vocab.eot_id is not None:
        writer.add_eot_token_id(vocab.eot_id)
    if vocab.eom_id is not None:
        writer.add_eom_token_id(vocab.eom_id)
    if vocab.add_bos is not None:
        writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- Loading them through forklm ----------------------------------------------------------------

# name -> how to build it (each trained once per module)
VOCABS = {
    "smollm2": _default_model_vocab,
    "qwen2": lambda: _byte_level_vocab("qwen2", "qwen2", QWEN2_SPLIT, False, bos=False),
    "llama-bpe": lambda: _byte_level_vocab("llama-bpe", "llama-bpe", LLAMA3_SPLIT, True, bos=True),
    # no add_bos_token key: llama.cpp adds BOS to llama-bpe all the same
    "llama-bpe-no-key": lambda: _byte_level_vocab("llama-bpe-no-key", "llama-bpe", LLAMA3_SPLIT,
                                                  None, bos=True),
    "gpt-2": lambda: _byte_level_vocab("gpt-2", "gpt-2", None, None, bos=False),
    "bloom": lambda: _byte_level_vocab("bloom", "bloom", BLOOM_SPLIT, None, bos=False),
    "gpt-4o": lambda: _byte_level_vocab("gpt-4o", "gpt-4o", GPT4O_SPLIT, False, bos=False,
                                        arch="gpt-oss"),
    # no add_bos_token / add_space_prefix keys: llama.cpp adds both to a sentencepiece vocabulary
    "spm-llama": lambda: _sentencepiece_vocab("spm-llama", "llama", None, None),
    "spm-llama-no-prefix": lambda: _sentencepiece_vocab("spm-llama-no-prefix", "llama", False,
                                                        False),
    "spm-gemma": lambda: _sentencepiece_vocab("spm-gemma", "gemma2", False, True),
}


def samples(vocab: Vocab) -> dict[str, str]:
    """SAMPLES, and a chat turn whose control tokens are written in the text."""
    chat = ("<s>[INST]  Hi there [/INST] Fine.</s>" if vocab.model == "llama"
            else "<|im_start|>user\n  Hi there<|im_end|>\n<|im_start|>assistant\nFine.")
    return {**SAMPLES, "control_tokens": chat}


@dataclass
class Loaded:
    vocab: Vocab
    path: pathlib.Path
    cache_dir: pathlib.Path  # FORKLM_CACHE_DIR
    first: GGUFModel  # converted from the GGUF
    cached: GGUFModel  # reloaded from forklm's cache
    hf: transformers.PreTrainedTokenizerBase  # transformers' own GGUF tokenizer


@pytest.fixture(scope="module", params=list(VOCABS))
def loaded(request, tmp_path_factory) -> Loaded:
    vocab = VOCABS[request.param]()
    folder = tmp_path_factory.mktemp(vocab.name)
    path = vocab.path or write_gguf(folder / f"{vocab.name}.gguf", vocab)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORKLM_CACHE_DIR", str(folder / "cache"))
        first = GGUFModel(path)
        assert gguf_loader._cache_dir_for(path).is_dir()
        cached = GGUFModel(path)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return Loaded(vocab, path, folder / "cache", first, cached, hf)


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.id_to_token(i) for i in ids]


@pytest.mark.parametrize("load", ["first", "cached"])
def test_encodes_as_the_original_tokenizer(loaded, load):
    tokenizer, original = getattr(loaded, load).tokenizer, loaded.vocab.original
    for name, text in samples(loaded.vocab).items():
        for specials in (True, False):
            want = original.encode(text, add_special_tokens=specials).ids
            got = tokenizer.encode(text, add_special_tokens=specials)
            assert _pieces(original, got) == _pieces(original, want), (name, specials)


@pytest.mark.parametrize("load", ["first", "cached"])
def test_decode_round_trips(loaded, load):
    tokenizer, original = getattr(loaded, load).tokenizer, loaded.vocab.original
    for name, text in samples(loaded.vocab).items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == original.decode(ids, skip_special_tokens=False), name
        if name != "control_tokens":  # there, llama.cpp's space after "<s>" decodes as a space
            assert tokenizer.decode(ids) == text, name
            assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


# llama.cpp's rule: tokenizer.ggml.add_bos_token when the file has it, else BOS for a sentencepiece
# vocabulary and for the llama3 family of byte-level pre-tokenizers.
ADDS_BOS = {"smollm2": False, "qwen2": False, "llama-bpe": True, "llama-bpe-no-key": True,
            "gpt-2": False, "bloom": False, "gpt-4o": False, "spm-llama": True,
            "spm-llama-no-prefix": False, "spm-gemma": True}


@pytest.mark.parametrize("load", ["first", "cached"])
def test_bos_eos_and_chat_template_from_the_metadata(loaded, load):
    model, vocab = getattr(loaded, load), loaded.vocab
    tokenizer = model.tokenizer
    tokens = GGUFFile(loaded.path).fields["tokenizer.ggml.tokens"]
    assert (tokenizer.bos_token, tokenizer.eos_token) == (tokens[vocab.bos_id],
                                                          tokens[vocab.eos_id])
    ends = [vocab.eos_id, vocab.eot_id, vocab.eom_id]
    # ... then the tokens llama.cpp ends generation at by their text (<|endoftext|>, ...)
    by_text = [i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS]
    assert model.eos_token_ids == list(dict.fromkeys(
        [*(i for i in ends if i is not None), *by_text]))
    ids = tokenizer.encode("Hi there")
    assert (ids[0] == vocab.bos_id) == ADDS_BOS[vocab.name]
    assert ids[-1] != vocab.eos_id  # llama.cpp adds no EOS unless add_eos_token says so
    assert tokenizer.chat_template == vocab.chat_template
    chat = tokenizer.apply_chat_template([{"role": "user", "content": " Grüße 1234"}],
                                         tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<s>[INST]" if vocab.model == "llama" else "<|im_start|>")
    assert (tokenizer.encode(chat, add_special_tokens=False)
            == vocab.original.encode(chat, add_special_tokens=False).ids)


def test_a_harmony_vocabulary_ends_turns_at_return_and_call(tmp_path, monkeypatch):
    """gpt-oss's harmony format: generation ends at <|return|> and <|call|> (and the file's eos),
    not at <|end|>, which closes the reasoning message before the answer (llama.cpp's rule)."""
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    specials = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|return|>", "<|call|>"]
    vocab = Vocab("harmony", _byte_level(GPT4O_SPLIT, specials, None, None), arch="gpt-oss",
                  model="gpt2", pre="gpt-4o", bos_id=0, eos_id=4, eot_id=2, add_bos=False,
                  chat_template=None)
    path = write_gguf(tmp_path / "harmony.gguf", vocab)
    for model in (GGUFModel(path), GGUFModel(path)):  # converted, then from the cache
        assert sorted(model.eos_token_ids) == [0, 4, 5]


def test_the_cache_keeps_the_whole_tokenizer(loaded):
    first, cached = loaded.first.tokenizer, loaded.cached.tokenizer
    parts = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model", "added_tokens")
    first_json, cached_json = (json.loads(t.backend_tokenizer.to_str()) for t in (first, cached))
    for part in parts:  # BOS/EOS: in the post-processor (transformers keeps no flag beside it)
        assert cached_json[part] == first_json[part], part
    assert cached.all_special_tokens == first.all_special_tokens


# Where transformers' own GGUF tokenizer (5.25) encodes otherwise than llama.cpp and the original
# tokenizer; forklm's tokenizer corrects each (runtime/models/gguf_tokenizer.py).
_DIGITS = ("`smollm` is split by GPT-2's regex alone, where llama.cpp and SmolLM2 split off every "
           "digit first: '   1234567' is 'ĠĠ','Ġ','1',... instead of 'ĠĠĠ','1',...")
_WHOLE_WORD = ("no whole-word lookup before merging for `llama-bpe` (llama.cpp's ignore_merges): "
               "the vocabulary's ' Bäume', which no merge makes, is cut into pieces")
_NO_BOS = "no add_bos_token key: no BOS, where llama.cpp adds one for `llama-bpe`"
_PREFIX_IGNORED = ("add_space_prefix=false is ignored for the llama architecture: text that does "
                   "not start with a space gets a '▁' in front")
_LEADING_SPACE = ("Metaspace adds no '▁' to text that starts with a space: '  two' is '▁','▁t',... "
                  "where llama.cpp (add_space_prefix) and sentencepiece write '▁','▁','▁t',...")
TRANSFORMERS_DIVERGES = {
    ("smollm2", "code"): _DIGITS,
    ("bloom", "code"): ("`bloom` is split by GPT-2's regex, where llama.cpp and BLOOM keep each "
                        "run of anything but spaces, brackets and a few punctuation marks whole: "
                        "' int:' is pre-split ' int',':' and encodes 't',':' for 't:'"),
    ("smollm2", "numbers"): _DIGITS,
    ("llama-bpe", "multilingual"): _WHOLE_WORD,
    **{("llama-bpe-no-key", name): _NO_BOS for name in [*SAMPLES, "control_tokens"]},
    ("llama-bpe-no-key", "multilingual"): f"{_NO_BOS}; {_WHOLE_WORD}",
    **{("spm-llama", name): _LEADING_SPACE for name, text in SAMPLES.items()
       if text.startswith(" ")},
    ("spm-llama", "control_tokens"): (
        "Metaspace adds no '▁' after a control token: '<s>[INST]' is '<s>','<0x5B>',... where "
        "llama.cpp prefixes each text run after a control token: '<s>','▁','<0x5B>',..."),
    **{("spm-llama-no-prefix", name): _PREFIX_IGNORED for name, text in SAMPLES.items()
       if not text.startswith(" ")},
}


@pytest.mark.parametrize("sample", [*SAMPLES, "control_tokens"])
def test_transformers_own_gguf_tokenizer(loaded, sample, request):
    """What forklm would get from transformers alone; each known divergence is an xfail."""
    reason = TRANSFORMERS_DIVERGES.get((loaded.vocab.name, sample))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(reason=f"transformers: {reason}", strict=True))
    text, original = samples(loaded.vocab)[sample], loaded.vocab.original
    for specials in (True, False):
        want = original.encode(text, add_special_tokens=specials).ids
        got = loaded.hf.encode(text, add_special_tokens=specials)
        assert _pieces(original, got) == _pieces(original, want), specials


def test_a_gguf_tokenizer_path_is_read_alike(loaded, monkeypatch):
    """load_model(tokenizer_path=FILE.gguf) reads the file as GGUFModel does."""
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(loaded.cache_dir))
    tokenizer = load_model(str(loaded.path), tokenizer_path=str(loaded.path)).tokenizer
    for name, text in samples(loaded.vocab).items():
        assert tokenizer.encode(text) == loaded.first.tokenizer.encode(text), name


def _class_picking_meta(path: pathlib.Path) -> dict:
    fields = GGUFFile(path).fields
    return {k: fields[k] for k in ("general.architecture", "general.name") if k in fields}


def test_the_tokenizer_class_is_the_one_auto_tokenizer_picks(loaded):
    """forklm picks AutoTokenizer's class for a GGUF without AutoTokenizer's config read (which
    parses the whole vocabulary with gguf-py: seconds on a real one)."""
    from forklm.runtime.models.gguf_tokenizer import _tokenizer_class

    assert _tokenizer_class(_class_picking_meta(loaded.path)) is type(loaded.hf)


@pytest.mark.parametrize("arch,name", [
    ("llama", "mistral"), ("llama", "Mistral 7B"), ("qwen3", None), ("gemma3", None),
    ("phi3", None), ("starcoder2", None), ("falcon", None), ("stablelm", None),
    ("nemotron", None), ("gpt2", None), ("bloom", None), ("qwen2moe", None), ("olmo2", None)])
def test_each_architecture_gets_auto_tokenizers_class(arch, name, tmp_path):
    """The same for the other architectures forklm serves, on a small byte-level vocabulary
    written under each (`general.name` "mistral" makes transformers read a Llama as Mistral).
    Architectures transformers' GGUF reader does not name as they are (qwen2moe, olmo2) keep
    the tokenizers backend."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from forklm.runtime.models.gguf_tokenizer import _tokenizer_class

    vocab = _byte_level_vocab("qwen2", "qwen2", QWEN2_SPLIT, False, bos=False, arch=arch)
    path = write_gguf(tmp_path / "t.gguf", vocab, name=name)
    expected = transformers.TokenizersBackend
    if arch in GGUF_SUPPORTED_ARCHITECTURES:
        expected = type(transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name))
    assert _tokenizer_class(_class_picking_meta(path)) is expected
