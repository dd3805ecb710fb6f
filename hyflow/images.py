"""Images as verl's multimodal rows hold them, decoded with PIL.

A row's `images` column is a list of `{"bytes": ...}` dicts (what verl's geo3k preprocessor and HF datasets' Image
feature write; a `{"bytes", "path"}` pair: the bytes win), `{"image": path}` or `{"path": ...}` dicts (a
`file://` prefix is allowed), raw bytes, paths, or PIL images. Each decodes to an RGB `PIL.Image`; anything else,
a missing file, a URL (hyflow never downloads), undecodable bytes or an image over PIL's pixel limit
(`PIL.Image.MAX_IMAGE_PIXELS`, a decompression-bomb guard: the size in the header is checked before any pixel is
decoded) is an `ImageError` naming the row and the image.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


class ImageError(ValueError):
    """An image value of a row that cannot be read; the message names the row and the image."""


class ImageTooLargeError(ImageError):
    """An image whose header claims more pixels than PIL's limit (a decompression bomb), refused undecoded."""


def _pixel_limit() -> int | None:
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS


def _too_large(where: str, pixels: int, size: tuple[int, int] | None = None) -> ImageTooLargeError:
    limit = _pixel_limit()
    shape = f"{size[0]}x{size[1]} = " if size else ""
    return ImageTooLargeError(
        f"{where}: the image is {shape}{pixels:,} pixels by its header, more than the limit of {limit:,} pixels "
        "(PIL.Image.MAX_IMAGE_PIXELS, PIL's guard against decompression bombs); refused without decoding it. "
        "Resize the image below the limit (or drop it); a program of your own may raise PIL.Image.MAX_IMAGE_PIXELS "
        "before hyflow loads the data if such images are intended")


def _check_size(image, where: str) -> None:
    limit = _pixel_limit()
    width, height = image.size
    if limit is not None and width * height > limit:
        raise _too_large(where, width * height, (width, height))


def _open(value: Any, where: str):
    """(the PIL image of one row value, opened from its header only: no pixels decoded; True when it came
    from a file or bytes here and must be closed). Refuses what `load_image` refuses, except undecodable pixels."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        _check_size(value, where)
        return value, False
    source = value
    if isinstance(value, dict):
        source = value.get("bytes") or value.get("image") or value.get("path")
        if source is None:
            raise ImageError(f"{where}: an image dict needs 'bytes', 'image' or 'path'; got keys {sorted(value)}")
        if isinstance(source, Image.Image):
            _check_size(source, where)
            return source, False
    if isinstance(source, (bytes, bytearray, memoryview)):
        opener = lambda: Image.open(io.BytesIO(bytes(source)))  # noqa: E731
    elif isinstance(source, (str, Path)):
        text = str(source)
        if _URL.match(text) and not text.startswith("file://"):
            raise ImageError(f"{where}: the image is a URL ({text[:200]!r}); hyflow never downloads images. "
                             "Download it first and give the local path ({'image': '/path/to/file.png'}) or the "
                             "file's bytes ({'bytes': ...}) in the row")
        path = Path(text.removeprefix("file://")).expanduser()
        if not path.is_file():
            raise ImageError(f"{where}: image file {str(path)!r} does not exist")
        opener = lambda: Image.open(path)  # noqa: E731
    else:
        raise ImageError(f"{where}: cannot read an image from a {type(source).__name__}; give {{'bytes': ...}}, "
                         "{'image': path} or a path")
    try:
        image = opener()  # PIL refuses past twice its limit itself (and only warns between one and two times it)
    except Image.DecompressionBombError as err:
        found = re.search(r"\((\d+) pixels\)", str(err))
        raise _too_large(where, int(found.group(1)) if found else -1) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{where}: the image cannot be decoded ({type(err).__name__}: {err}); is it a PNG, JPEG "
                         "or WebP file?") from None
    try:
        _check_size(image, where)
    except ImageError:
        image.close()
        raise
    return image, True


def load_image(value: Any, where: str = "image"):
    """The RGB PIL image of one row value (module docstring)."""
    from PIL import Image, UnidentifiedImageError

    image, opened = _open(value, where)
    if not opened:
        return image.convert("RGB")
    try:
        image.load()
        return image.convert("RGB")
    except Image.DecompressionBombError:
        raise _too_large(where, image.size[0] * image.size[1], image.size) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{where}: the image cannot be decoded ({type(err).__name__}: {err}); is it a PNG, JPEG "
                         "or WebP file?") from None
    finally:
        image.close()


def check_pixel_limit(data: bytes, where: str) -> None:
    """Raise ImageTooLargeError when the header of the image file `data` claims more pixels than PIL's limit;
    nothing is decoded (an unreadable header passes: decoding reports it)."""
    try:
        image, _ = _open(bytes(data), where)
    except ImageTooLargeError:
        raise
    except ImageError:
        return
    image.close()


def image_sizes(values: Sequence[Any], where: str) -> list[tuple[int, int]]:
    """(width, height) of every image of a row, read from the headers (no pixels decoded); refuses what
    `load_image` refuses, except pixels that turn out undecodable."""
    sizes = []
    for k, value in enumerate(values):
        image, opened = _open(value, f"{where}, image {k}")
        sizes.append(image.size)
        if opened:
            image.close()
    return sizes


def decode_images(values: Sequence[Any], where: str) -> list:
    """Every image of a row, decoded (`where` names the row; the image's index is added)."""
    return [load_image(value, f"{where}, image {k}") for k, value in enumerate(values)]
