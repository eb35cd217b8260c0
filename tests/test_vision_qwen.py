"""Qwen2.5-VL's and Qwen3-VL's images against transformers in fp32 on tiny random models (their
vision towers and patch mergers; Qwen2 / Qwen3 decoders turned by M-RoPE, in blocks / interleaved;
Qwen3-VL's deepstack features added after its first decoder layers): an image's tokens take 3-D
rotary positions (its rows and columns) and every later token, generated ones included, its
position less what the images saved. Checked with the positions themselves, greedy tokens and
prompt logprobs for text + one and two images batched with text-only requests, small prefill
chunks, a cached image prefix, the Hub's tensor names, and over HTTP."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch
import torch
import transformers

from forklm.runtime.models.loader import language_model_name
from forklm.runtime.multimodal.mrope import mrope_positions
from tests.conftest import assert_idle_and_clean
from tests.test_vision import (
    chat_about,
    data_url,
    greedy_tokens,
    picture,
    prompt_logprobs,
)
from tests.tiny_models import randomized

NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2.5-VL's chat template, in short: an image part is the placeholder between its markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}" + IMAGE + "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ONE = f"<|im_start|>user\nLook: {IMAGE} what is it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\nFirst {IMAGE} then {IMAGE}, compare.<|im_end|>\n<|im_start|>assistant\n"
PLAIN = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
MERGE = 2  # the tower's spatial merge: 2 x 2 patches per image token


def build(kind: str, folder, tokenizer):
    """(folder, transformers model, tokenizer, image processor) of a tiny Qwen2.5-VL or
    Qwen3-VL saved as a checkpoint."""
    tokenizer.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    tok.chat_template = CHAT_TEMPLATE  # the server renders chats with the tokenizer's
    images = transformers.Qwen2VLImageProcessor(min_pixels=8 * 8 * 4, max_pixels=64 * 64,
                                                patch_size=4, merge_size=MERGE,
                                                temporal_patch_size=2)
    # 16-dim heads: 8 frequencies; Qwen2.5-VL's 2 temporal, 3 for rows, 3 for columns in
    # blocks, Qwen3-VL's 2 rows and 2 columns interleaved with 4 temporal
    sections = [2, 3, 3] if kind == "qwen2_5_vl" else [4, 2, 2]
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": sections})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64)
    ids = tok.convert_tokens_to_ids
    tokens = dict(image_token_id=tok.image_token_id, video_token_id=ids("<|video_pad|>"),
                  vision_start_token_id=ids("<|vision_start|>"),
                  vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)
    if kind == "qwen2_5_vl":
        # windows of 4 x 4 patches (window_size in pixels): the 8-16 patch sides below span several
        vision.update(window_size=16, fullatt_block_indexes=[1])
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    else:  # deepstack features from both tower layers, added after both decoder layers
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen3VLForConditionalGeneration
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomized(model_class(config), 4.0)
    model.save_pretrained(folder)
    images.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, tok, images


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory, tokenizer):
    return build(request.param, tmp_path_factory.mktemp(request.param), tokenizer)


def hf_inputs(qwen, text: str, images: list) -> dict:
    """transformers' inputs: each placeholder expanded to its image's token count, as
    Qwen2_5_VLProcessor does (that class itself wants torchvision for its video processor)."""
    _, _, tok, processor = qwen
    pieces = text.split("<|image_pad|>")
    inputs: dict = {}
    if images:
        inputs = dict(processor(images=images, return_tensors="pt"))
        counts = (inputs["image_grid_thw"].prod(-1) // MERGE**2).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * n + piece
                                   for n, piece in zip(counts, pieces[1:]))
    ids = tok(text, return_tensors="pt")["input_ids"]
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == tok.image_token_id).int()}


def hf_greedy(qwen, text: str, images: list) -> list[int]:
    return greedy_tokens(qwen[1], hf_inputs(qwen, text, images), NEW_TOKENS)


def hf_prompt_logprobs(qwen, text: str, images: list) -> torch.Tensor:
    """[prompt_len - 1] log p(token t | tokens < t) of the prompt under transformers."""
    return prompt_logprobs(qwen[1], hf_inputs(qwen, text, images))


@pytest.fixture
def engine(make_engine, qwen):
    return make_engine(model_path=str(qwen[0]))


def test_mrope_positions_are_transformers(qwen):
    _, model, tok, _ = qwen
    pictures = [picture(1, 60, 40), picture(2, 24, 56)]
    inputs = hf_inputs(qwen, TWO, pictures)
    want, want_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    grids = [tuple(int(v) for v in g) for g in inputs["image_grid_thw"]]
    got, delta = mrope_positions(inputs["input_ids"][0].tolist(), tok.image_token_id, grids,
                                 MERGE)
    assert torch.equal(got, want[:, 0].T) and delta == int(want_delta) < 0
    plain = tok(PLAIN)["input_ids"]
    got, delta = mrope_positions(plain, tok.image_token_id, [], MERGE)
    assert torch.equal(got, torch.arange(len(plain))[:, None].expand(-1, 3)) and delta == 0


def test_images_turn_by_their_rows_and_columns_as_transformers(engine, qwen):
    wide, tall, small = picture(1, 60, 40), picture(2, 24, 56), picture(3, 20, 20)
    cases = [(ONE, [wide]), (TWO, [tall, small]), (PLAIN, []), (ONE, [small])]
    expected = [hf_greedy(qwen, text, images) for text, images in cases]
    assert len({tuple(e) for e in expected}) == len(expected)  # the images change the answer
    results = engine.generate([t for t, _ in cases], GREEDY,
                              image_data=[[data_url(im) for im in ims] or None
                                          for _, ims in cases])
    assert [r["output_ids"] for r in results] == expected
    assert_idle_and_clean(engine)


def test_prompt_logprobs_are_transformers(engine, qwen):
    pictures = [picture(4, 40, 40), picture(5, 56, 24)]
    engine.flush_cache()
    got = engine.generate(TWO, {**GREEDY, "max_new_tokens": 1}, image_data=pictures,
                          return_logprob=True, logprob_start_len=0)
    got_lp = torch.tensor([lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]])
    want = hf_prompt_logprobs(qwen, TWO, pictures)
    assert len(got_lp) == len(want) and (got_lp - want).abs().max() < 1e-4


def test_a_cached_image_prefix_and_small_chunks(make_engine, qwen):
    """The tokens after a cached image keep their shifted positions (the prefix is computed
    once, the question after it and the answer turn as transformers turns them); chunks of 5
    tokens cut images anywhere (causal attention: nothing to keep whole)."""
    image = picture(6, 48, 32)
    for chunked in (0, 5):
        engine = make_engine(model_path=str(qwen[0]), chunked_prefill_size=chunked or 8192)
        engine.flush_cache()
        first = engine.generate(ONE, GREEDY, image_data=image)
        assert first["output_ids"] == hf_greedy(qwen, ONE, [image])
        other = ONE.replace("what is it?", "and its colours?")
        again = engine.generate(other, GREEDY, image_data=image)
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["output_ids"] == hf_greedy(qwen, other, [image])
        assert_idle_and_clean(engine)


def test_the_hubs_tensor_names_load_the_same_model(make_engine, tokenizer, tmp_path):
    """The Hub's Qwen2.5-VL files name the decoder "model.layers..." beside "visual...";
    transformers 5 saves "model.language_model..." and "model.visual..." (as do the Hub's
    Qwen3-VL files): both load."""
    qwen = build("qwen2_5_vl", tmp_path / "saved", tokenizer)
    folder = tmp_path / "hub_names"
    shutil.copytree(qwen[0], folder)
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    renamed = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."):
               t for name, t in tensors.items()}
    assert any(n.startswith("visual.") for n in renamed) and "model.norm.weight" in renamed
    safetensors.torch.save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    assert language_model_name("model.layers.0.mlp.up_proj.weight", "qwen2_5_vl") == (
        "model.layers.0.mlp.up_proj.weight")
    assert language_model_name("visual.blocks.0.attn.qkv.weight", "qwen2_5_vl") is None
    assert language_model_name("model.visual.merger.mlp.0.weight", "qwen2_5_vl") is None
    assert language_model_name("model.layers.0.mlp.up_proj.weight") is None  # others: a tower's
    engine = make_engine(model_path=str(folder))
    image = picture(7, 40, 40)
    assert engine.generate(ONE, GREEDY, image_data=image)["output_ids"] == hf_greedy(
        qwen, ONE, [image])


def test_without_an_image_processor_the_text_is_served(make_engine, qwen, tmp_path):
    folder = tmp_path / "text_only"
    shutil.copytree(qwen[0], folder)
    (folder / "preprocessor_config.json").unlink()
    engine = make_engine(model_path=str(folder))
    assert engine.parts.intake.vision is None
    assert engine.generate(PLAIN, GREEDY)["output_ids"] == hf_greedy(qwen, PLAIN, [])


def test_chat_with_an_image_over_http(engine, qwen):
    image = picture(8, 50, 40)
    want = hf_greedy(qwen, ONE, [image])
    assert chat_about(engine, image, NEW_TOKENS) == qwen[2].decode(want)
