"""Images for a vision-language model (runtime/multimodal/) against transformers in fp32 on a tiny
random Idefics3 (a SigLIP-style tower, pixel-shuffle projector, Llama decoder): greedy tokens for
text + one and two images, batched with text-only requests; image features cached by hash and the
radix cache keyed by image; bad image inputs refused before any work proportional to them."""

from __future__ import annotations

import base64
import io

import numpy as np
import PIL.Image
import pytest
import torch
import transformers

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.multimodal.images import ImageLimits, load_images
from tests.conftest import assert_idle_and_clean
from tests.tiny_models import randomized

NEW_TOKENS = 10
# SmolVLM's chat template, in short: an image part is the placeholder the processor expands.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def picture(seed: int, width: int, height: int) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def data_url(image: PIL.Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def greedy_tokens(model, inputs: dict, new_tokens: int) -> list[int]:
    """A transformers model's greedy continuation of its processed `inputs`."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def prompt_logprobs(model, inputs: dict) -> torch.Tensor:
    """[prompt_len - 1] log p(token t | tokens < t) of a prompt under a transformers model, from
    its processed `inputs`."""
    with torch.no_grad():
        logits = model(**inputs).logits[0].log_softmax(-1)
    ids = inputs["input_ids"][0]
    return logits[:-1].gather(1, ids[1:, None])[:, 0]


def chat_about(engine, image: PIL.Image.Image, max_tokens: int) -> str:
    """The greedy reply of `engine`, served over HTTP, to one OpenAI chat message "Look: <the
    image as an image_url part> what is it?"."""
    import openai

    from tests.conftest import serve_in_thread

    server = serve_in_thread(engine)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="default", max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": " what is it?"}]}])
        return reply.choices[0].message.content
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, tokenizer):
    """(folder, transformers model, processor) of a tiny Idefics3 saved as a checkpoint."""
    folder = tmp_path_factory.mktemp("idefics3")
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path) \
        if tokenizer.name_or_path else None
    tok = tok or tokenizer
    images = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
    processor = transformers.Idefics3Processor(images, tok, image_seq_len=4,
                                               chat_template=CHAT_TEMPLATE)
    tok.chat_template = CHAT_TEMPLATE  # the server renders chats with the tokenizer's
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomized(transformers.Idefics3ForConditionalGeneration(config), 3.0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, model, processor


def hf_greedy(vlm, text: str, images: list[PIL.Image.Image]) -> list[int]:
    _, model, processor = vlm
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    return greedy_tokens(model, inputs, NEW_TOKENS)


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
ONE = "User:<image>What is in this picture?<end_of_utterance>\nAssistant:"
TWO = "User:Compare <image> with <image> please.<end_of_utterance>\nAssistant:"
PLAIN = "User:Say something.<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def engine(make_engine, vlm):
    return make_engine(model_path=str(vlm[0]))


def test_text_with_one_and_two_images_matches_transformers(engine, vlm):
    wide, tall, small = picture(1, 60, 40), picture(2, 30, 50), picture(3, 20, 20)
    cases = [(ONE, [wide]), (TWO, [tall, small]), (PLAIN, []), (ONE, [small])]
    expected = [hf_greedy(vlm, text, images) for text, images in cases]
    assert len({tuple(e) for e in expected}) == len(expected)  # the images change the answer
    results = engine.generate([t for t, _ in cases], GREEDY,
                              image_data=[[data_url(im) for im in ims] or None
                                          for _, ims in cases])
    assert [r["output_ids"] for r in results] == expected
    alone = engine.generate(ONE, GREEDY, image_data=wide)  # a PIL image, single prompt
    assert alone["output_ids"] == expected[0]
    assert_idle_and_clean(engine)


def test_a_repeated_image_is_cached_and_a_new_one_is_not(engine, vlm):
    vision = engine.parts.intake.vision
    image, other = picture(11, 48, 48), picture(12, 48, 48)
    engine.flush_cache()
    first = engine.generate(ONE, GREEDY, image_data=data_url(image))
    encoded = vision.images_encoded
    again = engine.generate(ONE, GREEDY, image_data=data_url(image))
    assert vision.images_encoded == encoded  # features from the cache, by the pixels' hash
    assert again["output_ids"] == first["output_ids"]
    prompt_len = again["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] == prompt_len - 1  # all but the last token
    swapped = engine.generate(ONE, GREEDY, image_data=data_url(other))
    assert vision.images_encoded == encoded + 1
    # Only the tokens before the first image token are shared with the other image's prompt.
    processor = vlm[2]
    ids = processor(text=[ONE], images=[[other]])["input_ids"][0]
    first_image_token = list(ids).index(processor.image_token_id)
    assert swapped["meta_info"]["cached_tokens"] == first_image_token > 0
    assert swapped["output_ids"] == hf_greedy(vlm, ONE, [other])


def test_bad_image_inputs_are_refused_naming_the_problem(engine):
    image = data_url(picture(5, 16, 16))
    cases = [
        (dict(image_data=[image, image]), "2 images.*1 image placeholders"),
        (dict(image_data="data:text/plain;base64,aGk="), "data:image"),
        (dict(image_data="not base64 !!"), "not a data URL or base64"),
        (dict(image_data="https://example.com/cat.png"), "remote images are not fetched"),
        (dict(image_data="data:image/png;base64," + base64.b64encode(b"junk").decode()),
         "not a readable image"),
        (dict(image_data=[image] * 17), "at most 16 images"),
    ]
    for kwargs, why in cases:
        with pytest.raises(InvalidArgumentError, match=why):
            engine.generate(ONE, GREEDY, **kwargs)
    with pytest.raises(InvalidArgumentError, match="not token ids"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, image_data=image)
    with pytest.raises(InvalidArgumentError, match="one entry .* per prompt"):
        engine.generate([ONE, ONE], GREEDY, image_data=[image])
    huge = picture(6, 300, 300)
    with pytest.raises(InvalidArgumentError, match="at most 100 pixels"):
        load_images(data_url(huge), ImageLimits(max_image_pixels=100))
    with pytest.raises(InvalidArgumentError, match="together"):
        load_images([data_url(huge)] * 2, ImageLimits(max_total_pixels=100_000))
    assert_idle_and_clean(engine)


def test_a_text_model_refuses_images(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidArgumentError, match="reads no images"):
        engine.generate("hi", GREEDY, image_data=data_url(picture(1, 8, 8)))


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server with one PNG at /cat.png (a remote image source for the allow-list)."""
    import http.server
    import threading

    buffer = io.BytesIO()
    picture(21, 40, 30).save(buffer, format="PNG")
    body = buffer.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_generate_and_chat_with_images(engine, vlm, image_host):
    import httpx
    import openai

    from tests.conftest import serve_in_thread

    image = picture(31, 50, 40)
    url_image = picture(21, 40, 30)
    server = serve_in_thread(engine, allowed_image_url_prefixes=(f"{image_host}/",))
    try:
        base = server.base_url
        native = httpx.post(f"{base}/generate", json={
            "text": ONE, "sampling_params": GREEDY, "image_data": data_url(image)},
            timeout=60).json()
        assert native["output_ids"] == hf_greedy(vlm, ONE, [image])
        batch = httpx.post(f"{base}/generate", json={
            "text": [ONE, PLAIN], "sampling_params": GREEDY,
            "image_data": [[data_url(image)], None]}, timeout=60).json()
        assert batch[0]["output_ids"] == native["output_ids"]
        assert batch[1]["output_ids"] == hf_greedy(vlm, PLAIN, [])
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        for source, pixels in ((data_url(image), image), (f"{image_host}/cat.png", url_image)):
            reply = client.chat.completions.create(
                model="default", max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": source}}]}])
            prompt = "User:What is in this picture?<image><end_of_utterance>\nAssistant:"
            expected = engine.generate(prompt, GREEDY, image_data=pixels)["text"]
            assert reply.choices[0].message.content == expected
        import anthropic

        b64 = data_url(image).split(",", 1)[1]
        message = anthropic.Anthropic(base_url=base, api_key="none").messages.create(
            model="default", max_tokens=NEW_TOKENS, extra_body={"temperature": 0}, messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64}}]}])
        prompt = "User:What is in this picture?<image><end_of_utterance>\nAssistant:"
        expected = engine.generate(prompt, {"max_new_tokens": NEW_TOKENS, "temperature": 0},
                                   image_data=image)["text"]
        assert "".join(b.text for b in message.content if b.type == "text") == expected
        response = client.responses.create(
            model="default", max_output_tokens=NEW_TOKENS, temperature=0, input=[
                {"role": "user", "content": [
                    {"type": "input_text", "text": "What is in this picture?"},
                    {"type": "input_image", "image_url": data_url(image)}]}])
        assert response.output_text == expected
        refused = httpx.post(f"{base}/v1/chat/completions", json={
            "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]})
        assert refused.status_code == 400 and "remote images are not fetched" in refused.text
        audio = httpx.post(f"{base}/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]})
        assert audio.status_code in (400, 422) and "input_audio" in audio.text
        path = httpx.post(f"{base}/generate", json={"text": ONE, "image_data": "/etc/hostname"})
        assert path.status_code == 400 and "not a data URL or base64" in path.text
    finally:
        server.stop()


def test_an_image_request_leaves_its_thread_no_openmp_team(engine):
    """The vision tower runs on the thread that prepares the request (here this one): the
    OpenMP team it starts would make libgomp throttle the engine threads' spin, so the intake
    lets it go (runtime/cpu_threads.py)."""
    import os

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    engine.generate(PLAIN, GREEDY)  # text only: no team to start
    before = threads()
    engine.flush_cache()  # the image is encoded again, not taken from the cache
    engine.generate(ONE, GREEDY, image_data=data_url(picture(21, 36, 28)))
    assert threads() == before
