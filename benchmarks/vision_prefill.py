"""An image request's prefill on a SmolVLM-256M-shaped model (random weights: speed does not
depend on their values): SigLIP-B/16 at 512 px (12 layers, 768 wide), pixel shuffle x4, the
SmolLM2-135M decoder. One request, one image, 1 new token, timed end to end:

- cold: a new image (the vision tower runs for every tile, then the prompt is prefilled);
- same image again, cache flushed: the tower's features come from the image cache, the prompt
  is prefilled again;
- same image again: features cached and the whole prompt a radix-cache hit;
- text only, a prompt of about as many tokens (what the decoder's prefill alone costs).

Run: `python -m benchmarks.vision_prefill [--repeats 3] [--width 1024 --height 768]`.
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

PROMPT = "User:<image>Describe this image.<end_of_utterance>\nAssistant:"


def build(folder: str) -> None:
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


def timed(engine: Engine, prompt: str, image: PIL.Image.Image | None) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(prompt, {"max_new_tokens": 1}, image_data=image)
    return time.perf_counter() - t0, out["meta_info"]["prompt_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        engine = Engine(model_path=folder, dtype=args.dtype, max_total_tokens=16384)
        rows: dict[str, list[float]] = {"cold (tower + prefill)": [],
                                        "image cached, prefill again": [],
                                        "image cached, prompt cached": [], "text only": []}
        tokens = text_tokens = 0
        for _ in range(args.repeats):
            image = PIL.Image.fromarray(
                (rng.random((args.height, args.width, 3)) * 255).astype("uint8"))
            engine.flush_cache()
            wall, tokens = timed(engine, PROMPT, image)
            rows["cold (tower + prefill)"].append(wall)
            engine.flush_cache()
            rows["image cached, prefill again"].append(timed(engine, PROMPT, image)[0])
            rows["image cached, prompt cached"].append(timed(engine, PROMPT, image)[0])
            words = " ".join(f"w{rng.integers(1_000_000)}" for _ in range(tokens // 4))
            wall, text_tokens = timed(engine, words, None)
            rows["text only"].append(wall)
        print(f"CPU: {cpu_flags()}; dtype {args.dtype}; torch threads {torch.get_num_threads()}; "
              f"one {args.width}x{args.height} image = {tokens} prompt tokens, the text-only "
              f"prompt {text_tokens}; "
              f"{args.repeats} repeats (medians)")
        for name, walls in rows.items():
            print(f"{name:32s} {statistics.median(walls) * 1000:9.1f} ms")
        engine.shutdown()


if __name__ == "__main__":
    main()
