"""Check an image before it goes on the bus, and scale it to what its model can use.

A worker's processor scales every image to its model's size anyway; a photo
of 4000 x 3000 pixels would only cost the bus and the worker. So an image
larger than four times the pixels the model keeps (ServedModel.image_pixels:
twice its width and height) is scaled down here and sent as PNG; a smaller one
goes as it came, byte for byte. Decoding it here also proves it is an image,
so that a worker never gets one it cannot open.
"""

from __future__ import annotations

import io
import math

from PIL import Image

from gateway.media.loader import MediaRefused

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_DECODED_PIXELS = 64 * 2**20  # 8192 x 8192: above it, a small file may decode to gigabytes (a "bomb")
HEADROOM = 4  # pixels kept beyond the model's, so that its processor still does the final scaling


def checked_image(data: bytes, model_pixels: int | None) -> bytes:
    """The image as workers get it; MediaRefused if it is not one we can read."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise MediaRefused(f"image_url: {image.format} images are not accepted ({', '.join(FORMATS)})")
            width, height = image.size
            if width * height > MAX_DECODED_PIXELS:
                raise MediaRefused(
                    f"image_url: the image has {width} x {height} pixels; at most {MAX_DECODED_PIXELS} are decoded"
                )
            image.load()  # a truncated or corrupt file fails here, not on a worker
            limit = HEADROOM * model_pixels if model_pixels else None
            if limit is None or width * height <= limit:
                return data
            scale = math.sqrt(limit / (width * height))
            size = (max(1, int(width * scale)), max(1, int(height * scale)))
            out = io.BytesIO()
            image.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(out, format="PNG")
            return out.getvalue()
    except MediaRefused:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise MediaRefused(f"image_url: not an image that can be read: {error}") from None
