"""Image inputs as requests give them (SGLang's image_data, OpenAI's image_url parts): decoded to
RGB pixels, bounded before anything proportional to them runs, and hashed by their pixels.

A request controls every size here, so each is checked in order of cost: the count of images,
the encoded bytes, the pixel count the image's header declares (before decoding it), then the
request's total pixels. Remote URLs are fetched only from prefixes the operator allowed, and
local files only through the Python API (a server never reads a path a client names).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pathlib
from dataclasses import dataclass
from typing import Any

from forklm.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 16  # per request (prompt)
    max_image_bytes: int = 20 * 1024 * 1024  # one encoded image
    max_image_pixels: int = 4096 * 4096  # one decoded image
    max_total_pixels: int = 8 * 4096 * 4096  # all images of a request
    # URL prefixes (e.g. "https://images.example.com/") a server may fetch; none by default.
    allowed_url_prefixes: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    allow_files: bool = False  # local paths: the Python API's, never a server's


@dataclass(frozen=True)
class Image:
    """A decoded RGB image and the hash of its pixels (what caches and the radix cache key)."""

    pixels: Any  # PIL.Image.Image, mode RGB
    digest: bytes  # 16 bytes of blake2b over size + pixels

    @property
    def num_pixels(self) -> int:
        return int(self.pixels.width * self.pixels.height)


def load_images(items: Any, limits: ImageLimits, name: str = "image_data") -> list[Image]:
    """One prompt's images: a list of items (or one item), each a data URL, base64 text, raw
    bytes, a PIL image, an allowed http(s) URL, or (allow_files) a local path."""
    listed = items if isinstance(items, (list, tuple)) else [items]
    if len(listed) > limits.max_images:
        raise InvalidArgumentError(name, f"<{len(listed)} images>",
                                   f"at most {limits.max_images} images per request")
    images = [_load_one(item, limits, f"{name}[{i}]") for i, item in enumerate(listed)]
    total = sum(image.num_pixels for image in images)
    if total > limits.max_total_pixels:
        raise InvalidArgumentError(name, f"<{total} pixels>", "the images hold more than "
                                   f"{limits.max_total_pixels} pixels together")
    return images


def _load_one(item: Any, limits: ImageLimits, name: str) -> Image:
    import PIL.Image

    if isinstance(item, Image):  # decoded already (by a server, under its own limits)
        return item
    if isinstance(item, PIL.Image.Image):
        _check_pixels(item.width, item.height, limits, name)
        return _hashed(item.convert("RGB"))
    return _decode(_encoded_bytes(item, limits, name), limits, name)


def _encoded_bytes(item: Any, limits: ImageLimits, name: str) -> bytes:
    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
    elif not isinstance(item, str):
        raise InvalidArgumentError(name, type(item).__name__, "expected an image: a data URL, "
                                   "base64 text, bytes or a PIL image")
    elif item.startswith("data:"):
        header, sep, payload = item.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise InvalidArgumentError(name, header[:64], "expected data:image/<type>;base64,...")
        data = _b64(payload, limits, name)
    elif item.startswith(("http://", "https://")):
        data = _fetch(item, limits, name)
    elif limits.allow_files and pathlib.Path(item).is_file():
        path = pathlib.Path(item)
        if path.stat().st_size > limits.max_image_bytes:
            raise InvalidArgumentError(name, item, f"larger than {limits.max_image_bytes} bytes")
        data = path.read_bytes()
    else:
        data = _b64(item, limits, name)
    if len(data) > limits.max_image_bytes:
        raise InvalidArgumentError(name, f"<{len(data)} bytes>",
                                   f"an image may take at most {limits.max_image_bytes} bytes")
    return data


def _b64(text: str, limits: ImageLimits, name: str) -> bytes:
    if len(text) > limits.max_image_bytes * 4 // 3 + 4:  # before decoding it
        raise InvalidArgumentError(name, f"<{len(text)} chars>",
                                   f"an image may take at most {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(name, text[:32] + "...", "not a data URL or base64 image "
                                   "(remote URLs need the server's allow-list; local paths "
                                   "are read only by the Python API)") from None


def _fetch(url: str, limits: ImageLimits, name: str) -> bytes:
    if not any(url.startswith(prefix) for prefix in limits.allowed_url_prefixes):
        raise InvalidArgumentError(name, url[:200], "remote images are not fetched: send the "
                                   "image as a data URL (the server fetches only from the URL "
                                   "prefixes its operator allows)")
    import httpx

    chunks: list[bytes] = []
    size = 0
    try:
        with httpx.stream("GET", url, timeout=limits.fetch_timeout_s,
                          follow_redirects=False) as response:
            if response.status_code != 200:
                raise InvalidArgumentError(name, url[:200], f"fetching it gave HTTP "
                                           f"{response.status_code}")
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise InvalidArgumentError(name, url[:200], "larger than "
                                               f"{limits.max_image_bytes} bytes")
                chunks.append(chunk)
    except httpx.HTTPError as e:
        raise InvalidArgumentError(name, url[:200], f"could not be fetched: {e}") from None
    return b"".join(chunks)


def _decode(data: bytes, limits: ImageLimits, name: str) -> Image:
    import PIL.Image

    try:
        with PIL.Image.open(io.BytesIO(data)) as opened:
            # The header's size, checked before the pixels are decoded (a decompression bomb).
            _check_pixels(opened.width, opened.height, limits, name)
            return _hashed(opened.convert("RGB"))
    except InvalidArgumentError:
        raise
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
        raise InvalidArgumentError(name, f"<{len(data)} bytes>",
                                   f"not a readable image: {e}") from None


def _check_pixels(width: int, height: int, limits: ImageLimits, name: str) -> None:
    if width < 1 or height < 1 or width * height > limits.max_image_pixels:
        raise InvalidArgumentError(name, f"<{width}x{height}>", "an image may hold at most "
                                   f"{limits.max_image_pixels} pixels")


def _hashed(rgb: Any) -> Image:
    digest = hashlib.blake2b(f"{rgb.width}x{rgb.height}".encode(), digest_size=16)
    digest.update(rgb.tobytes())
    return Image(rgb, digest.digest())
