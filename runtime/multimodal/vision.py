"""The vision stage of a vision-language model (Idefics3, SmolVLM, Gemma 3): a prompt with images
becomes token ids (the model's own processor expands each image placeholder into its image
tokens) and one feature row per image token (the vision tower and its projector, run once per
image and cached by the image's hash), which the decoder takes in place of those tokens'
embeddings.

The tower and projector are transformers' own modules, loaded from the checkpoint: they run once
per image, outside the decode loop, so there is nothing for a custom kernel to win here. The
radix cache keys each image token by its image's hash (`MultimodalPrompt.key_ids`), so a repeated
image (a screenshot at the start of every turn) is a shared prefix and two images never are.

Gemma 3's image tokens attend to every token of their own image, later ones included (a causal
mask elsewhere): each run of image tokens is a block (`MultimodalPrompt.blocks`) that a prefill
chunk never cuts (`chunk_end`) and whose queries see keys up to the block's end (`key_ends`,
which the attention backends apply). A cached prefix may still end inside a block: its keys
were computed with the whole block in view, and the rest of the block is computed in one chunk.

Qwen2.5-VL and Qwen3-VL turn their image tokens by 3-D rotary positions (M-RoPE: the image's row
and column) and every later token by its position less what the images saved
(runtime/multimodal/mrope.py); their image processor and tokenizer are used directly (their
processor classes want torchvision's video processor), the placeholder expanded to the image's
token count as those processors do. Qwen3-VL's tower also gives features from its middle layers
(deepstack), which the decoder adds to the image tokens after its first layers.
"""

from __future__ import annotations

import collections
import pathlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from forklm.runtime.errors import InvalidArgumentError, UnsupportedModelError
from forklm.runtime.multimodal.images import Image
from forklm.runtime.multimodal.mrope import mrope_positions

if TYPE_CHECKING:
    from forklm.runtime.models.loader import LoadedModel

# Key ids of image tokens are above every vocabulary and below the namespaces' 2**32.
_KEY_SPACE = 2**31


@dataclass
class MultimodalPrompt:
    """What a request with images carries: where its image tokens are and their feature rows."""

    positions: torch.Tensor  # [k] int64, sorted prompt positions of the image tokens
    features: torch.Tensor  # [k, hidden] in the model's dtype, row i for positions[i]
    key_ids: list[int]  # the prompt as the radix cache keys it (image tokens by image hash)
    # [start, end) prompt positions of each block of image tokens that attend to each other both
    # ways (Gemma 3's images), in order; empty where attention is causal throughout.
    blocks: tuple[tuple[int, int], ...] = ()
    # M-RoPE (Qwen2.5-VL): [prompt_len, 3] int64 rotary positions of the prompt, and the shift of
    # every later position (generated tokens turn by position + rope_delta); None: the positions.
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    # Qwen3-VL: [layers, k, hidden], row i added to positions[i]'s hidden state after each of
    # the decoder's first layers; None: no such features.
    deep_features: torch.Tensor | None = None

    def rows_in(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The image tokens among prompt positions [start, end): (their positions, features)."""
        lo, hi = self._span(start, end)
        return self.positions[lo:hi], self.features[lo:hi]

    def deep_in(self, start: int, end: int) -> torch.Tensor | None:
        """The deepstack rows [layers, m, hidden] of the image tokens among [start, end)."""
        if self.deep_features is None:
            return None
        lo, hi = self._span(start, end)
        return self.deep_features[:, lo:hi]

    def _span(self, start: int, end: int) -> tuple[int, int]:
        return (int(torch.searchsorted(self.positions, start)),
                int(torch.searchsorted(self.positions, end)))

    def rope_rows(self, start: int, end: int) -> torch.Tensor:
        """[end - start, 3] rotary positions of sequence positions [start, end) (M-RoPE)."""
        assert self.rope_positions is not None, "a prompt with M-RoPE positions"
        prompt_len = len(self.rope_positions)
        head = self.rope_positions[start:min(end, prompt_len)]
        if end <= prompt_len:
            return head
        tail = torch.arange(max(start, prompt_len), end) + self.rope_delta
        return torch.cat((head, tail[:, None].expand(-1, 3)))

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk of positions [start, end) ends so that it cuts no block: before
        the block `end` falls inside, or after it where the chunk starts inside or at that block
        (a chunk of at least one whole block, over its planned length)."""
        for block_start, block_end in self.blocks:
            if block_start < end < block_end:
                return block_start if block_start > start else block_end
        return end

    def key_ends(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """For the chunk of positions [start, end): (first, last + 1, key end) of each run of its
        tokens that see keys past their own position (the rest of their block)."""
        runs = []
        for block_start, block_end in self.blocks:
            lo, hi = max(block_start, start), min(block_end, end)
            if lo < hi:
                assert block_end <= end, f"a chunk [{start}, {end}) cut the image block " \
                    f"[{block_start}, {block_end})"
                runs.append((lo, hi, block_end))
        return runs


@dataclass(frozen=True)
class _Family:
    """Where a family's checkpoint keeps its image stage, and how its image tokens attend."""

    kind: str  # "idefics3" (tiles, pixel shuffle), "gemma3" or "qwen_vl"
    # checkpoint name prefixes of the tower's and the projector's tensors, longest first (the
    # Hub's names and transformers 5's, which nests the modules under "model."); no projector
    # prefixes: the tower ends in its own (Qwen2.5-VL's merger)
    tower_prefixes: tuple[str, ...]
    projector_prefixes: tuple[str, ...] = ()
    deepstack: bool = False  # the tower's middle layers' features join the decoder's (Qwen3-VL)

    @property
    def bidirectional(self) -> bool:
        """An image's tokens attend to each other both ways (Gemma 3)."""
        return self.kind == "gemma3"

    @property
    def mrope(self) -> bool:
        """Image tokens turn by 3-D rotary positions (Qwen-VL)."""
        return self.kind == "qwen_vl"


_IDEFICS3 = _Family("idefics3", ("model.vision_model.",), ("model.connector.",))
FAMILIES = {
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    "gemma3": _Family("gemma3", ("model.vision_tower.vision_model.", "model.vision_tower.",
                                 "vision_tower.vision_model.", "vision_tower."),
                      ("model.multi_modal_projector.", "multi_modal_projector.")),
    "qwen2_5_vl": _Family("qwen_vl", ("model.visual.", "visual.")),
    "qwen3_vl": _Family("qwen_vl", ("model.visual.", "visual."), deepstack=True),
}


@dataclass(frozen=True)
class _Encoded:
    features: torch.Tensor  # [tokens, hidden] in the model's dtype
    grid: tuple[int, int, int] | None  # Qwen-VL: the image's (t, h, w) patch grid
    deep: torch.Tensor | None  # Qwen3-VL: [layers, tokens, hidden] deepstack features


class VisionStage:
    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, max_cached_images: int = 64):
        import transformers

        outer = loaded.vision_config
        assert outer is not None and loaded.shards is not None, "a vision-language checkpoint"
        if outer.model_type not in FAMILIES:
            raise UnsupportedModelError(f"images of a {outer.model_type} model are not read")
        self.family = FAMILIES[outer.model_type]
        self.dtype, self.max_cached = dtype, max_cached_images
        if self.family.mrope:
            self.processor = None
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(
                loaded.source, local_files_only=True)
            self.tokenizer = loaded.tokenizer
            self.placeholder = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
            self.merge_size = int(outer.vision_config.spatial_merge_size)
        else:
            self.processor = transformers.AutoProcessor.from_pretrained(
                loaded.source, local_files_only=True)
            self.image_processor = self.processor.image_processor
            self.placeholder = getattr(self.processor, "image_token", "<image>")
        self.image_token_id = int(outer.image_token_id)
        self.vocab_size = int(loaded.config.vocab_size)
        self.tower, self.projector = _tower_and_projector(outer)
        self.patch_size = int(outer.vision_config.patch_size)
        _load(self.tower, self.projector, loaded.shards, self.family)
        for module in (self.tower, self.projector):
            if module is not None:
                module.to(dtype).eval()
        self._lock = threading.Lock()  # the cache; the tower itself runs outside it
        self._cache: collections.OrderedDict[bytes, _Encoded] = collections.OrderedDict()
        self.images_encoded = 0  # tower runs (cache misses), for tests and stats

    def prepare(self, text: str, images: list[Image], name: str = "image_data"
                ) -> tuple[list[int], MultimodalPrompt]:
        """`text` with one image placeholder per image (the chat template writes them) ->
        (token ids, the image tokens' features). Raises InvalidArgumentError naming `name`."""
        placeholder = self.placeholder
        if text.count(placeholder) != len(images):
            raise InvalidArgumentError(name, f"<{len(images)} images>",
                                       f"the prompt has {text.count(placeholder)} image "
                                       f"placeholders ({placeholder!r}); give one per image")
        encoded = [self._encoded(image) for image in images]
        features = [e.features for e in encoded]
        if self.processor is None:  # each placeholder stands for its image's tokens
            pieces = text.split(placeholder)
            expanded = pieces[0] + "".join(placeholder * len(f) + piece
                                           for f, piece in zip(features, pieces[1:]))
            ids = list(self.tokenizer(expanded)["input_ids"])
        else:
            ids = self.processor(text=[text], images=[[im.pixels for im in images]],
                                 return_tensors="pt")["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(len(f) for f in features):
            raise InvalidArgumentError(name, f"<{len(images)} images>", "the prompt's image "
                                       f"tokens ({len(positions)}) do not match its images")
        key_ids = list(ids)
        at = 0
        for image, rows in zip(images, features):
            key = self.vocab_size + int.from_bytes(image.digest[:8], "little") % (
                _KEY_SPACE - self.vocab_size)
            for p in positions[at: at + len(rows)]:
                key_ids[p] = key
            at += len(rows)
        blocks = _runs(positions) if self.family.bidirectional else ()
        rope_positions, rope_delta = None, 0
        if self.family.mrope:
            grids = [e.grid for e in encoded]
            rope_positions, rope_delta = mrope_positions(ids, self.image_token_id, grids,
                                                         self.merge_size)
        deep = None
        if self.family.deepstack:
            deep = torch.cat([e.deep for e in encoded if e.deep is not None], dim=1)
        return ids, MultimodalPrompt(torch.tensor(positions, dtype=torch.int64),
                                     torch.cat(features), key_ids, blocks, rope_positions,
                                     rope_delta, deep)

    def _encoded(self, image: Image) -> _Encoded:
        """One image's feature rows [tokens, hidden] (and grid), from the cache or the tower."""
        with self._lock:
            cached = self._cache.get(image.digest)
            if cached is not None:
                self._cache.move_to_end(image.digest)
                return cached
        kind = self.family.kind
        images = [image.pixels] if kind == "qwen_vl" else [[image.pixels]]
        # Gemma3Processor's own defaults (pan-and-scan off) win over its image processor's
        # config: the same here, so the features match the tokens the processor wrote.
        defaults = getattr(self.processor, "images_kwargs", None) if kind == "gemma3" else None
        inputs = self.image_processor(images=images, return_tensors="pt", **(defaults or {}))
        pixels = inputs["pixel_values"].to(self.dtype)
        grid, deep = None, None
        with torch.inference_mode():
            if kind == "idefics3":  # [1, tiles, 3, H, W], a mask of each tile's padding
                mask = inputs.get("pixel_attention_mask")
                features = self._encode_tiles(pixels[0], None if mask is None else mask[0])
            elif kind == "gemma3":  # [views, 3, H, W] (the image, then any pan-and-scan crops)
                assert self.projector is not None
                hidden = self.tower(pixel_values=pixels).last_hidden_state
                projected = self.projector(hidden)  # [views, mm_tokens_per_image, hidden]
                features = projected.reshape(-1, projected.shape[-1]).contiguous()
            else:  # Qwen-VL: [patches, 3 * t * p * p] and the patch grid; merged in the tower
                grid_thw = inputs["image_grid_thw"]
                out = self.tower(pixels, grid_thw=grid_thw)
                features = out.pooler_output.contiguous()
                t, h, w = (int(v) for v in grid_thw[0])
                grid = (t, h, w)
                if self.family.deepstack:
                    deep = torch.stack(out.deepstack_features).contiguous()
        encoded = _Encoded(features, grid, deep)
        with self._lock:
            self.images_encoded += 1
            self._cache[image.digest] = encoded
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return encoded

    def _encode_tiles(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None
                      ) -> torch.Tensor:
        """Idefics3's get_image_features for one image's tiles: patches the mask covers, the
        tower, the pixel-shuffle projector; rows of all tiles in order."""
        if pixel_mask is None:
            pixel_mask = torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool)
        patch = self.patch_size
        grid = pixel_mask.bool().unfold(1, patch, patch).unfold(2, patch, patch)
        patch_mask = grid.sum(dim=(-1, -2)) > 0
        hidden = self.tower(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state
        assert self.projector is not None
        projected = self.projector(hidden)  # [tiles, image_seq_len, text hidden]
        return projected.reshape(-1, projected.shape[-1]).contiguous()


def _tower_and_projector(outer: Any) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    if outer.model_type == "idefics3":
        from transformers.models.idefics3 import modeling_idefics3 as m

        return (m.Idefics3VisionTransformer._from_config(outer.vision_config),
                m.Idefics3Connector(outer))
    if outer.model_type == "smolvlm":
        from transformers.models.smolvlm import modeling_smolvlm as s

        return (s.SmolVLMVisionTransformer._from_config(outer.vision_config),
                s.SmolVLMConnector(outer))
    import transformers

    if outer.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q

        return q.Qwen2_5_VisionTransformerPretrainedModel._from_config(outer.vision_config), None
    if outer.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl import modeling_qwen3_vl as q3

        return q3.Qwen3VLVisionModel._from_config(outer.vision_config), None
    from transformers.models.gemma3 import modeling_gemma3 as g

    assert outer.model_type == "gemma3", outer.model_type  # FAMILIES names no other
    return (transformers.AutoModel.from_config(outer.vision_config),  # SigLIP's tower
            g.Gemma3MultiModalProjector(outer))


def _runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted positions -> the [start, end) of each run of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return tuple(runs)


def _load(tower: torch.nn.Module, projector: torch.nn.Module | None,
          shards: list[pathlib.Path], family: _Family) -> None:
    """The tower's and projector's tensors from the checkpoint (all of them, or an error)."""
    parts: list[tuple[tuple[str, ...], torch.nn.Module, dict[str, torch.Tensor]]] = [
        (family.tower_prefixes, tower, {})]
    if projector is not None:
        parts.append((family.projector_prefixes, projector, {}))
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                for prefixes, _, found in parts:
                    prefix = next((p for p in prefixes if name.startswith(p)), None)
                    if prefix is not None:
                        found[name[len(prefix):]] = f.get_tensor(name)
                        break
    for prefixes, module, found in parts:
        missing, unexpected = module.load_state_dict(found, strict=False)
        if missing or unexpected:
            raise UnsupportedModelError(
                f"the checkpoint's {prefixes[0].rstrip('.')} does not fit the config: missing "
                f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
