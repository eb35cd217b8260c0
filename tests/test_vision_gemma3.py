"""Gemma 3's images against transformers in fp32 on a tiny random Gemma3ForConditionalGeneration
(a SigLIP tower, the average-pooling projector, Gemma 3's decoder with sliding and global
layers): the tokens of one image attend to each other both ways in the prefill, causal
attention elsewhere. Checked with greedy tokens and logprobs for text + one and two images
batched with text-only requests, with prefill chunks smaller than an image, with a cached
prefix that ends inside an image, on the batch-invariant backend, and over HTTP."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers

from forklm.runtime.multimodal.vision import MultimodalPrompt
from tests.conftest import assert_idle_and_clean
from tests.test_vision import (
    chat_about,
    data_url,
    greedy_tokens,
    picture,
    prompt_logprobs,
)
from tests.tiny_models import randomized, tiny_config

NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
IMAGE_TOKENS = 4  # mm_tokens_per_image: a 2 x 2 pooling of the tower's 4 x 4 patches
# Gemma 3's chat template, in short: an image part is the placeholder the processor expands.
CHAT_TEMPLATE = (
    "{% for message in messages %}<turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<start_of_image>{% endif %}{% endfor %}{% endif %}"
    "<end_turn>\n{% endfor %}{% if add_generation_prompt %}<turn>model\n{% endif %}")
ONE = "<turn>user\nLook: <start_of_image> what is it?<end_turn>\n<turn>model\n"
TWO = "<turn>user\nFirst <start_of_image> then <start_of_image>, compare.<end_turn>\n<turn>model\n"
PLAIN = "<turn>user\nSay something.<end_turn>\n<turn>model\n"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer):
    """(folder, transformers model, processor) of a tiny Gemma 3 saved as a checkpoint."""
    folder = tmp_path_factory.mktemp("gemma3")
    tokenizer.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>"})
    tok.chat_template = CHAT_TEMPLATE  # the server renders chats with the tokenizer's
    images = transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = transformers.Gemma3Processor(images, tok, image_seq_length=IMAGE_TOKENS,
                                             chat_template=CHAT_TEMPLATE)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=32, patch_size=8)
    config = transformers.Gemma3Config(
        text_config=tiny_config("gemma3", tok).to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=IMAGE_TOKENS, image_token_id=tok.image_token_id,
        boi_token_id=tok.convert_tokens_to_ids(tok.boi_token),
        eoi_token_id=tok.convert_tokens_to_ids(tok.eoi_token))
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomized(transformers.Gemma3ForConditionalGeneration(config), 4.0)
    with torch.no_grad():  # transformers starts it at zero: every image would read the same
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 32 ** -0.5)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, model, processor


def hf_inputs(gemma3, text: str, images: list) -> dict:
    return dict(gemma3[2](text=[text], images=[images] if images else None, return_tensors="pt"))


def hf_greedy(gemma3, text: str, images: list, bidirectional: bool = True) -> list[int]:
    """transformers' greedy tokens; bidirectional=False drops token_type_ids, so its image
    tokens attend causally (what a server without the block mask would compute)."""
    inputs = hf_inputs(gemma3, text, images)
    if not bidirectional:
        inputs.pop("token_type_ids", None)
    return greedy_tokens(gemma3[1], inputs, NEW_TOKENS)


def hf_prompt_logprobs(gemma3, text: str, images: list, bidirectional: bool = True
                       ) -> torch.Tensor:
    """[prompt_len - 1] log p(token t | tokens < t) of the prompt under transformers."""
    inputs = hf_inputs(gemma3, text, images)
    if not bidirectional:
        inputs.pop("token_type_ids", None)
    return prompt_logprobs(gemma3[1], inputs)


@pytest.fixture
def engine(make_engine, gemma3):
    """The default config's engine (make_engine keeps it, or remakes it after another
    config's engine took its place)."""
    return make_engine(model_path=str(gemma3[0]))


def test_images_attend_within_themselves_as_transformers_does(engine, gemma3):
    wide, tall, small = picture(1, 60, 40), picture(2, 30, 50), picture(3, 20, 20)
    cases = [(ONE, [wide]), (TWO, [tall, small]), (PLAIN, []), (ONE, [small])]
    expected = [hf_greedy(gemma3, text, images) for text, images in cases]
    assert len({tuple(e) for e in expected}) == len(expected)  # the images change the answer
    # The block mask changes them too: a causal prefill would answer otherwise.
    assert any(hf_greedy(gemma3, text, images, bidirectional=False) != want
               for (text, images), want in zip(cases, expected) if images)
    results = engine.generate([t for t, _ in cases], GREEDY,
                              image_data=[[data_url(im) for im in ims] or None
                                          for _, ims in cases])
    assert [r["output_ids"] for r in results] == expected
    assert_idle_and_clean(engine)


def test_prompt_logprobs_inside_an_image_are_transformers(engine, gemma3):
    image = picture(4, 40, 40)
    want = hf_prompt_logprobs(gemma3, ONE, [image])
    causal = hf_prompt_logprobs(gemma3, ONE, [image], bidirectional=False)
    engine.flush_cache()
    got = engine.generate(ONE, {**GREEDY, "max_new_tokens": 1}, image_data=image,
                          return_logprob=True, logprob_start_len=0)
    got_lp = torch.tensor([lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]])
    assert len(got_lp) == len(want)
    assert (got_lp - want).abs().max() < 1e-4
    assert (causal - want).abs().max() > 1e-2  # so the comparison tells the two apart


def test_prefill_chunks_smaller_than_an_image_keep_it_whole(make_engine, gemma3):
    """Chunks of 3 tokens against images of 4: a chunk ending inside an image stops before it,
    and one starting at an image takes all of it."""
    engine = make_engine(model_path=str(gemma3[0]), chunked_prefill_size=3)
    cases = [(ONE, [picture(5, 50, 30)]), (TWO, [picture(6, 30, 30), picture(7, 40, 20)])]
    for text, images in cases:
        engine.flush_cache()
        result = engine.generate(text, GREEDY, image_data=images)
        assert result["output_ids"] == hf_greedy(gemma3, text, images)
    assert_idle_and_clean(engine)


def test_chunk_end_never_cuts_a_block():
    mm = MultimodalPrompt(torch.arange(0), torch.zeros(0, 1), [], blocks=((5, 9), (12, 16)))
    assert mm.chunk_end(0, 3) == 3  # before any block
    assert mm.chunk_end(0, 7) == 5  # ends inside: back to the block's start
    assert mm.chunk_end(5, 7) == 9  # starts at the block: all of it
    assert mm.chunk_end(6, 7) == 9  # starts inside (a cached prefix ended there): the rest
    assert mm.chunk_end(3, 13) == 12
    assert mm.chunk_end(9, 12) == 12 and mm.chunk_end(0, 5) == 5  # at a boundary: as planned
    assert mm.key_ends(3, 12) == [(5, 9, 9)]
    assert mm.key_ends(6, 16) == [(6, 9, 9), (12, 16, 16)]
    with pytest.raises(AssertionError, match="cut the image block"):
        mm.key_ends(0, 7)
    rng = np.random.default_rng(0)
    for _ in range(200):
        start = int(rng.integers(0, 16))
        end = mm.chunk_end(start, start + int(rng.integers(1, 8)))
        assert end > start
        assert all(not (s < end < e) for s, e in mm.blocks)


def test_a_cached_prefix_ending_inside_an_image(engine, gemma3):
    """The cache holds the whole prompt; a request whose reusable prefix stops inside the image
    (its prompt logprobs start there) computes the rest of the image in one chunk, with the
    cached part in view, and scores its tokens as transformers does."""
    image = picture(8, 40, 30)
    processor = gemma3[2]
    ids = hf_inputs(gemma3, ONE, [image])["input_ids"][0].tolist()
    first = ids.index(processor.tokenizer.image_token_id)
    engine.flush_cache()
    engine.generate(ONE, GREEDY, image_data=image)
    start = first + 2  # logprobs from inside the image: the prefix may reuse first + 1 tokens
    got = engine.generate(ONE, GREEDY, image_data=image, return_logprob=True,
                          logprob_start_len=start)
    assert got["meta_info"]["cached_tokens"] == start - 1
    assert got["output_ids"] == hf_greedy(gemma3, ONE, [image])
    got_lp = torch.tensor([lp for lp, _, _ in got["meta_info"]["input_token_logprobs"]])
    want = hf_prompt_logprobs(gemma3, ONE, [image])[start - 1:]
    assert len(got_lp) == len(want) and (got_lp - want).abs().max() < 1e-4
    assert_idle_and_clean(engine)


def test_batch_invariant_attention_reads_the_image_blocks(make_engine, gemma3):
    engine = make_engine(model_path=str(gemma3[0]), enable_deterministic_inference=True)
    image, pair = picture(9, 30, 40), [picture(10, 20, 30), picture(11, 30, 30)]
    scored, answered = engine.generate(
        [ONE, TWO], GREEDY, image_data=[[data_url(image)], [data_url(im) for im in pair]],
        return_logprob=True, logprob_start_len=0)
    got_lp = torch.tensor([lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]])
    assert (got_lp - hf_prompt_logprobs(gemma3, ONE, [image])).abs().max() < 1e-4
    assert answered["output_ids"] == hf_greedy(gemma3, TWO, pair)
    assert_idle_and_clean(engine)


def test_triton_backend_runs_image_chunks_with_their_mask(make_engine, gemma3):
    """The Triton kernels' keys end at each query (TRITON_INTERPRET=1 runs them here): a chunk
    with image blocks takes SDPA with the block mask over the same pool, the rest the kernels."""
    engine = make_engine(model_path=str(gemma3[0]), attention_backend="triton")
    image = picture(1, 60, 40)
    want = hf_greedy(gemma3, ONE, [image])
    assert hf_greedy(gemma3, ONE, [image], bidirectional=False) != want
    results = engine.generate([ONE, PLAIN], GREEDY, image_data=[[data_url(image)], None])
    assert [r["output_ids"] for r in results] == [want, hf_greedy(gemma3, PLAIN, [])]
    assert_idle_and_clean(engine)


def test_an_image_processor_config_with_pan_and_scan_reads_as_the_processor_does(
        make_engine, gemma3, tmp_path):
    """Gemma3Processor turns pan-and-scan off unless a call asks for it (its own defaults win
    over the image processor's config), so a checkpoint whose image processor config turns it
    on is read as one view per image, as transformers' processor reads it: not as the crops the
    image processor alone would make."""
    folder = tmp_path / "pan_and_scan"
    shutil.copytree(gemma3[0], folder)
    images = transformers.Gemma3ImageProcessor(
        size={"height": 32, "width": 32}, do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
        pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.2)
    processor = transformers.Gemma3Processor(images, gemma3[2].tokenizer,
                                             image_seq_length=IMAGE_TOKENS,
                                             chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    reference = (folder, gemma3[1], processor)
    wide = picture(13, 90, 30)
    assert len(images(images=[[wide]], return_tensors="pt")["pixel_values"]) == 4  # crops
    assert len(hf_inputs(reference, ONE, [wide])["pixel_values"]) == 1  # the processor: none
    engine = make_engine(model_path=str(folder))
    assert engine.generate(ONE, GREEDY, image_data=wide)["output_ids"] == hf_greedy(
        reference, ONE, [wide])
    assert_idle_and_clean(engine)


def test_chat_with_an_image_over_http(engine, gemma3):
    image = picture(12, 50, 40)
    want = hf_greedy(gemma3, ONE, [image])
    assert chat_about(engine, image, NEW_TOKENS) == gemma3[2].tokenizer.decode(want)
