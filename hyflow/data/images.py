"""Images as verl's multimodal rows hold them, decoded with PIL.

A row's `images` column is a list of `{"bytes": ...}` dicts (what verl's geo3k preprocessor and HF datasets' Image
feature write; a `{"bytes", "path"}` pair: the bytes win), `{"image": path}` or `{"path": ...}` dicts (a
`file://` prefix is allowed), raw bytes, paths, or PIL images. Each decodes to an RGB `PIL.Image`; anything else,
a missing file or undecodable bytes is an `ImageError` naming the row and the image.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class ImageError(ValueError):
    """An image value of a row that cannot be read; the message names the row and the image."""


def load_image(value: Any, where: str = "image"):
    """The RGB PIL image of one row value (module docstring)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    source = value
    if isinstance(value, dict):
        source = value.get("bytes") or value.get("image") or value.get("path")
        if source is None:
            raise ImageError(f"{where}: an image dict needs 'bytes', 'image' or 'path'; got keys {sorted(value)}")
        if isinstance(source, Image.Image):
            return source.convert("RGB")
    if isinstance(source, (bytes, bytearray, memoryview)):
        opener = lambda: Image.open(io.BytesIO(bytes(source)))  # noqa: E731
    elif isinstance(source, (str, Path)):
        path = Path(str(source).removeprefix("file://")).expanduser()
        if not path.is_file():
            raise ImageError(f"{where}: image file {str(path)!r} does not exist")
        opener = lambda: Image.open(path)  # noqa: E731
    else:
        raise ImageError(f"{where}: cannot read an image from a {type(source).__name__}; give {{'bytes': ...}}, "
                         "{'image': path} or a path")
    try:
        image = opener()
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{where}: the image cannot be decoded ({type(err).__name__}: {err}); is it a PNG, JPEG "
                         "or WebP file?") from None
    return image.convert("RGB")


def decode_images(values: Sequence[Any], where: str) -> list:
    """Every image of a row, decoded (`where` names the row; the image's index is added)."""
    return [load_image(value, f"{where}, image {k}") for k, value in enumerate(values)]
