"""A request's images as the server reads them: decoded under the server's own limits (no local
files; remote URLs only from the operator's allowed prefixes) before they reach the engine, in a
worker thread (decoding grows with the image)."""

from __future__ import annotations

from typing import Any

from forklm.runtime.multimodal.images import Image, ImageLimits, load_images
from forklm.server.config import ServerConfig


def image_limits(config: ServerConfig) -> ImageLimits:
    return ImageLimits(allowed_url_prefixes=tuple(config.allowed_image_url_prefixes),
                       allow_files=False)


def decode_image_data(image_data: Any, single: bool, limits: ImageLimits) -> Any:
    """/generate's image_data, decoded in its shape: one prompt's entry (an image or a list), or
    a list of one entry per prompt (None for a prompt without images)."""
    if image_data is None:
        return None
    if single or not isinstance(image_data, list):  # not a list: the intake names the shape
        return load_images(image_data, limits)
    return [None if entry is None else load_images(entry, limits, f"image_data[{i}]")
            for i, entry in enumerate(image_data)]


def chat_image_urls(messages: list[Any]) -> list[str]:
    """The image_url parts of a chat, in the order the template renders them."""
    return [part.image_url.url for m in messages if isinstance(m.content, list)
            for part in m.content if part.type == "image_url"]


def decode_chat_images(messages: list[Any], limits: ImageLimits) -> list[Image] | None:
    urls = chat_image_urls(messages)
    return load_images(urls, limits, "messages.image_url") if urls else None
