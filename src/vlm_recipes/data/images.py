"""Photos as a photo viewer shows them, before any processor sees them.

Real datasets hold phone photos with an EXIF orientation, CMYK and grayscale JPEGs, palette PNGs with a
transparent colour and 16-bit PNGs. datasets' Image feature applies the EXIF orientation when it decodes;
the processors convert to RGB, compositing transparency over white, but a 16-bit image (PIL mode `I;16`
or `I`) reaches them unscaled, and PIL's own `convert("RGB")` clips it to white. `upright_rgb` does what
both do and the 16-bit scaling neither does, for every place an image meets a processor (the collators,
the caches, evaluation), and `upright_size` gives the size the model will see from the file header alone
(the length check), orientation included.
"""

from __future__ import annotations

from PIL import Image, ImageOps

ORIENTATION = 0x0112  # EXIF tag
TRANSPOSED = {5, 6, 7, 8}  # orientations that swap width and height
WHITE = (255, 255, 255, 255)


def upright_rgb(image: Image.Image) -> Image.Image:
    """An RGB image the right way up: EXIF orientation applied, transparency over white, 16-bit and
    32-bit grayscale scaled to 8 bits, CMYK, grayscale and palette converted. RGB images without an
    orientation are returned as they are."""
    if image.getexif().get(ORIENTATION, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        image = _to_8_bits(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        over_white = Image.new("RGBA", image.size, WHITE)
        return Image.alpha_composite(over_white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _to_8_bits(image: Image.Image) -> Image.Image:
    """16-bit grayscale (0-65535) to 8 bits by the full range, as viewers show it; 32-bit integer and
    float images by their own maximum."""
    import numpy as np

    values = np.asarray(image, dtype=np.float64)
    top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
    if image.mode in ("I", "F") and values.max(initial=0) > 65535:
        top = float(values.max())
    return Image.fromarray(np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8), mode="L")


def upright_size(opened: Image.Image) -> tuple[int, int]:
    """(height, width) as the model sees the image, read from the header: a photo taken with the phone
    upright is stored sideways with orientation 6 or 8, so its width and height swap."""
    height, width = opened.height, opened.width
    if opened.getexif().get(ORIENTATION, 1) in TRANSPOSED:
        return width, height
    return height, width
