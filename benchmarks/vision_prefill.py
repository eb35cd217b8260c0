"""An image request's prefill on a vision-language model of a real one's shape (random weights:
speed does not depend on their values). One request, one image, 1 new token, timed end to end:

- cold: a new image (the vision tower runs for every tile, then the prompt is prefilled);
- same image again, cache flushed: the tower's features come from the image cache, the prompt
  is prefilled again;
- same image again: features cached and the whole prompt a radix-cache hit;
- text only, a prompt of about as many tokens (what the decoder's prefill alone costs).

Shapes (`--shape`):
- smolvlm-256m: SigLIP-B/16 at 512 px tiles (12 layers, 768 wide), pixel shuffle x4, the
  SmolLM2-135M decoder;
- qwen3-vl-2b: Qwen3-VL-2B's tower (24 layers, 1024 wide, 16 px patches at the image's own
  size, 2 x 2 merge, deepstack from 3 layers) and its Qwen3-1.7B decoder (28 layers, 2048
  wide, M-RoPE), the SmolLM2 tokenizer in its 151,936-row vocabulary.

Run: `python -m benchmarks.vision_prefill [--shape S] [--repeats 3] [--width 1024 --height 768]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import PIL.Image
import torch
import transformers

from benchmarks.quant_speed import cpu_flags
from forklm import Engine
from forklm.runtime.models.loader import load_model

PROMPTS = {
    "smolvlm-256m": "User:<image>Describe this image.<end_of_utterance>\nAssistant:",
    "qwen3-vl-2b": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this "
                   "image.<|im_end|>\n<|im_start|>assistant\n",
}


def build(folder: str, shape: str) -> None:
    if shape == "qwen3-vl-2b":
        build_qwen3_vl(folder)
        return
    tok = load_model("SmolLM2-135M-Instruct").tokenizer
    images = transformers.Idefics3ImageProcessor(
        size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}, do_image_splitting=True)
    processor = transformers.Idefics3Processor(images, tok, image_seq_len=64)
    text = dict(vocab_size=len(tok), hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_theta=100000.0)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, image_size=512, patch_size=16)
    config = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=4,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    model = transformers.Idefics3ForConditionalGeneration(config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def build_qwen3_vl(folder: str) -> None:
    """Qwen3-VL-2B-Instruct's shapes, written in bf16 (random init in bf16: 4.3 GB, not 8.6)."""
    base = load_model("SmolLM2-135M-Instruct").tokenizer
    base.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    images = transformers.Qwen2VLImageProcessor(patch_size=16, merge_size=2,
                                                temporal_patch_size=2, min_pixels=64 * 32 * 32,
                                                max_pixels=16384 * 32 * 32)
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                 "mrope_section": [24, 20, 20]})
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=2048, num_position_embeddings=2304,
                  deepstack_visual_indexes=[5, 11, 17])
    ids = tok.convert_tokens_to_ids
    config = transformers.Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=tok.image_token_id,
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    images.save_pretrained(folder)
    tok.save_pretrained(folder)


def timed(engine: Engine, prompt: str, image: PIL.Image.Image | None) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(prompt, {"max_new_tokens": 1}, image_data=image)
    return time.perf_counter() - t0, out["meta_info"]["prompt_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(PROMPTS), default="smolvlm-256m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        build(folder, args.shape)
        engine = Engine(model_path=folder, dtype=args.dtype, max_total_tokens=16384)
        rows: dict[str, list[float]] = {"cold (tower + prefill)": [],
                                        "image cached, prefill again": [],
                                        "image cached, prompt cached": [], "text only": []}
        tokens = text_tokens = 0
        for _ in range(args.repeats):
            image = PIL.Image.fromarray(
                (rng.random((args.height, args.width, 3)) * 255).astype("uint8"))
            engine.flush_cache()
            prompt = PROMPTS[args.shape]
            wall, tokens = timed(engine, prompt, image)
            rows["cold (tower + prefill)"].append(wall)
            engine.flush_cache()
            rows["image cached, prefill again"].append(timed(engine, prompt, image)[0])
            rows["image cached, prompt cached"].append(timed(engine, prompt, image)[0])
            words = " ".join(f"w{rng.integers(1_000_000)}" for _ in range(tokens // 4))
            wall, text_tokens = timed(engine, words, None)
            rows["text only"].append(wall)
        print(f"{args.shape}; CPU: {cpu_flags()}; dtype {args.dtype}; torch threads {torch.get_num_threads()}; "
              f"one {args.width}x{args.height} image = {tokens} prompt tokens, the text-only "
              f"prompt {text_tokens}; "
              f"{args.repeats} repeats (medians)")
        for name, walls in rows.items():
            print(f"{name:32s} {statistics.median(walls) * 1000:9.1f} ms")
        engine.shutdown()


if __name__ == "__main__":
    main()
