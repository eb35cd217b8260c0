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

    def rows_in(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The image tokens among prompt positions [start, end): (their positions, features)."""
        lo = int(torch.searchsorted(self.positions, start))
        hi = int(torch.searchsorted(self.positions, end))
        return self.positions[lo:hi], self.features[lo:hi]

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

    # checkpoint name prefixes of the tower's and the projector's tensors, longest first (the
    # Hub's names and transformers 5's, which nests the modules under "model.")
    tower_prefixes: tuple[str, ...]
    projector_prefixes: tuple[str, ...]
    bidirectional: bool  # an image's tokens attend to each other both ways (Gemma 3)


_IDEFICS3 = _Family(("model.vision_model.",), ("model.connector.",), bidirectional=False)
FAMILIES = {
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,
    "gemma3": _Family(("model.vision_tower.vision_model.", "model.vision_tower.",
                       "vision_tower.vision_model.", "vision_tower."),
                      ("model.multi_modal_projector.", "multi_modal_projector."),
                      bidirectional=True),
}


class VisionStage:
    def __init__(self, loaded: LoadedModel, dtype: torch.dtype, max_cached_images: int = 64):
        import transformers

        outer = loaded.vision_config
        assert outer is not None and loaded.shards is not None, "a vision-language checkpoint"
        if outer.model_type not in FAMILIES:
            raise UnsupportedModelError(f"images of a {outer.model_type} model are not read")
        self.family = FAMILIES[outer.model_type]
        self.dtype, self.max_cached = dtype, max_cached_images
        self.processor = transformers.AutoProcessor.from_pretrained(
            loaded.source, local_files_only=True)
        self.image_token_id = int(outer.image_token_id)
        self.vocab_size = int(loaded.config.vocab_size)
        self.tower, self.projector = _tower_and_projector(outer)
        self.patch_size = int(outer.vision_config.patch_size)
        _load(self.tower, self.projector, loaded.shards, self.family)
        self.tower.to(dtype).eval()
        self.projector.to(dtype).eval()
        self._lock = threading.Lock()  # the cache; the tower itself runs outside it
        self._cache: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self.images_encoded = 0  # tower runs (cache misses), for tests and stats

    def prepare(self, text: str, images: list[Image], name: str = "image_data"
                ) -> tuple[list[int], MultimodalPrompt]:
        """`text` with one image placeholder per image (the chat template writes them) ->
        (token ids, the image tokens' features). Raises InvalidArgumentError naming `name`."""
        placeholder = getattr(self.processor, "image_token", "<image>")
        if text.count(placeholder) != len(images):
            raise InvalidArgumentError(name, f"<{len(images)} images>",
                                       f"the prompt has {text.count(placeholder)} image "
                                       f"placeholders ({placeholder!r}); give one per image")
        ids = self.processor(text=[text], images=[[im.pixels for im in images]],
                             return_tensors="pt")["input_ids"][0].tolist()
        features = [self._features(image) for image in images]
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
        return ids, MultimodalPrompt(torch.tensor(positions, dtype=torch.int64),
                                     torch.cat(features), key_ids, blocks)

    def _features(self, image: Image) -> torch.Tensor:
        """One image's feature rows [tokens, hidden], from the cache or the tower."""
        with self._lock:
            cached = self._cache.get(image.digest)
            if cached is not None:
                self._cache.move_to_end(image.digest)
                return cached
        inputs = self.processor.image_processor(images=[[image.pixels]], return_tensors="pt")
        pixels = inputs["pixel_values"].to(self.dtype)
        with torch.inference_mode():
            if self.family is _IDEFICS3:  # [1, tiles, 3, H, W], a mask of each tile's padding
                mask = inputs.get("pixel_attention_mask")
                features = self._encode_tiles(pixels[0], None if mask is None else mask[0])
            else:  # Gemma 3: [views, 3, H, W] (the image, then any pan-and-scan crops)
                hidden = self.tower(pixel_values=pixels).last_hidden_state
                projected = self.projector(hidden)  # [views, mm_tokens_per_image, hidden]
                features = projected.reshape(-1, projected.shape[-1]).contiguous()
        with self._lock:
            self.images_encoded += 1
            self._cache[image.digest] = features
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return features

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
        projected = self.projector(hidden)  # [tiles, image_seq_len, text hidden]
        return projected.reshape(-1, projected.shape[-1]).contiguous()


def _tower_and_projector(outer: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    if outer.model_type == "idefics3":
        from transformers.models.idefics3 import modeling_idefics3 as m

        return (m.Idefics3VisionTransformer._from_config(outer.vision_config),
                m.Idefics3Connector(outer))
    if outer.model_type == "smolvlm":
        from transformers.models.smolvlm import modeling_smolvlm as s

        return (s.SmolVLMVisionTransformer._from_config(outer.vision_config),
                s.SmolVLMConnector(outer))
    import transformers
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


def _load(tower: torch.nn.Module, projector: torch.nn.Module, shards: list[pathlib.Path],
          family: _Family) -> None:
    """The tower's and projector's tensors from the checkpoint (all of them, or an error)."""
    parts: list[tuple[tuple[str, ...], torch.nn.Module, dict[str, torch.Tensor]]] = [
        (family.tower_prefixes, tower, {}), (family.projector_prefixes, projector, {})]
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
