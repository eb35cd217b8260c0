"""M-RoPE positions (Qwen2.5-VL): the rotary position of each prompt token as 3 numbers
(temporal, height, width), which the model's rotary splits its frequencies between.

A text token's three are equal: the position of the text so far. An image's tokens (its patch
grid after the spatial merge, row by row) all start at that position: temporal + 0, height +
row, width + column; the text after it resumes at that position + max(rows, columns), not at
the image's token count. So every token after an image turns by its sequence position plus a
shift (`rope_delta`, negative): the prompt's largest position + 1 - its length.
"""

from __future__ import annotations

import torch


def mrope_positions(ids: list[int], image_token_id: int,
                    grids: list[tuple[int, int, int] | None], merge_size: int
                    ) -> tuple[torch.Tensor, int]:
    """(positions [len(ids), 3] int64, rope_delta) of a prompt whose image tokens are, in order,
    each image's t * (h / merge) * (w / merge) tokens for its patch grid (t, h, w)."""
    rows: list[torch.Tensor] = []
    pos, i, images = 0, 0, iter(grids)
    while i < len(ids):
        if ids[i] != image_token_id:
            j = i
            while j < len(ids) and ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(pos, pos + j - i)[:, None].expand(-1, 3))
            pos, i = pos + j - i, j
            continue
        grid = next(images, None)
        assert grid is not None, "more image tokens than images"
        t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                    indexing="ij")
        rows.append(torch.stack((tt, hh, ww), dim=-1).reshape(-1, 3) + pos)
        pos, i = pos + max(h, w), i + t * h * w
    positions = torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)
    assert len(positions) == len(ids), "an image's tokens do not fill its grid"
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.contiguous(), delta
