#!/usr/bin/python3
"""Renders Shoal's OCR test images from known text, with a manifest.

Usage: /usr/bin/python3 scripts/make_ocr_images.py --out testdata/ocr [--force]

Writes into DIR/:
  eng.png          four English lines, black on white
  eng.jpg          three other English lines, JPEG quality 90
  eng.tif/.bmp/.pnm one short English line in each of these formats
  vie.png          four Vietnamese lines with diacritics (for lang "vie")
  large.png        English lines on a light noisy background, 5.0-5.6 MiB:
                   the noise defeats PNG compression so the file is large
                   while the text stays easy to read
  manifest.json    for each image: file, format, lang, width, height, the
                   rendered lines and their words (punctuation stripped),
                   plus the generator stamp

Needs Pillow (python3-pil) and DejaVu Sans (fonts-dejavu-core), both from
Debian. Idempotent: when manifest.json carries the current stamp and every
image exists, nothing is rewritten (--force rebuilds). Output is
deterministic (seeded noise), though not byte-identical across Pillow/zlib
versions.
"""

import argparse
import hashlib
import json
import os
import random
import sys

try:
    from PIL import Image, ImageDraw, ImageFont
except ImportError:
    sys.exit(f"make_ocr_images.py: {sys.executable} has no Pillow; install python3-pil "
             "(scripts/install-deps.sh) and run it with /usr/bin/python3")

GENERATOR_VERSION = 1
FONT_CANDIDATES = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
]
LARGE_MIN_BYTES = 5 * 1024 * 1024
LARGE_MAX_BYTES = int(5.6 * 1024 * 1024)

ENG_LINES = [
    "The quick brown fox jumps over the lazy dog",
    "Shoal serves small models from a work queue",
    "Workers pull batches and return the results",
    "Invoice number 12345 was paid on Monday",
]
ENG_JPEG_LINES = [
    "Reading text from photos of printed pages",
    "Every word comes back with its own box",
    "Confidence values help filter noisy output",
]
ENG_SHORT_LINES = ["Simple formats still carry clear text"]
VIE_LINES = [
    "Xin chào thế giới",
    "Tiếng Việt có dấu",
    "Hôm nay trời đẹp lắm",
    "Chúng tôi đọc sách mỗi ngày",
]
LARGE_LINES = [
    "Large uploads must still be recognised",
    "This page is several megabytes in size",
    "The background noise resists compression",
    "Yet every printed word remains legible",
]


def find_font():
    for path in FONT_CANDIDATES:
        if os.path.exists(path):
            return path
    sys.exit("make_ocr_images.py: DejaVuSans.ttf not found; install fonts-dejavu-core")


def words_of(lines):
    out = []
    for line in lines:
        for w in line.split():
            w = w.strip(".,;:!?\"'()")
            if w:
                out.append(w)
    return out


def render(lines, font_path, size, margin, line_gap, background=None):
    """Black text on white (or on `background`, an RGB image it is drawn on)."""
    font = ImageFont.truetype(font_path, size)
    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    widths, heights = [], []
    for line in lines:
        left, top, right, bottom = probe.textbbox((0, 0), line, font=font)
        widths.append(right)
        heights.append(bottom)
    line_h = max(heights) + line_gap
    w = max(widths) + 2 * margin
    h = line_h * len(lines) + 2 * margin - line_gap
    if background is None:
        img = Image.new("RGB", (w, h), "white")
    else:
        img = background
        assert img.size[0] >= w and img.size[1] >= h, (img.size, w, h)
    draw = ImageDraw.Draw(img)
    y = margin
    for line in lines:
        draw.text((margin, y), line, font=font, fill=(0, 0, 0))
        y += line_h
    return img


def noisy_background(w, h, seed):
    # Uniform per-channel noise in [215, 255]: ~5.4 bits a byte that deflate
    # cannot remove, yet far lighter than the black text for binarisation.
    data = random.Random(seed).randbytes(w * h * 3)
    table = bytes(215 + (i * 41) // 256 for i in range(256))
    return Image.frombytes("RGB", (w, h), data.translate(table))


def save_large(path, font_path):
    # Width fixed, height searched so the PNG lands in [5.0, 5.6] MiB.
    w, h = 2200, 1300
    for _ in range(8):
        img = render(LARGE_LINES, font_path, 72, 120, 60, noisy_background(w, h, 20240701))
        img.save(path + ".tmp", format="PNG")
        n = os.path.getsize(path + ".tmp")
        if LARGE_MIN_BYTES <= n <= LARGE_MAX_BYTES:
            os.replace(path + ".tmp", path)
            return img.size
        target = (LARGE_MIN_BYTES + LARGE_MAX_BYTES) / 2
        h = max(800, int(h * target / n))
    os.remove(path + ".tmp")
    sys.exit(f"make_ocr_images.py: could not size large.png into the 5.0-5.6 MiB band (last {n} B)")


def save(img, path, fmt, **kw):
    img.save(path + ".tmp", format=fmt, **kw)
    os.replace(path + ".tmp", path)


def stamp():
    with open(os.path.abspath(__file__), "rb") as f:
        src = f.read()
    return f"v{GENERATOR_VERSION}-{hashlib.sha256(src).hexdigest()[:16]}"


def build(out, font_path):
    os.makedirs(out, exist_ok=True)
    entries = []

    def add(file, fmt, lang, lines, size):
        entries.append(dict(file=file, format=fmt, lang=lang, width=size[0], height=size[1],
                            lines=lines, words=words_of(lines)))

    img = render(ENG_LINES, font_path, 40, 40, 24)
    save(img, os.path.join(out, "eng.png"), "PNG")
    add("eng.png", "png", "eng", ENG_LINES, img.size)

    img = render(ENG_JPEG_LINES, font_path, 40, 40, 24)
    save(img, os.path.join(out, "eng.jpg"), "JPEG", quality=90)
    add("eng.jpg", "jpeg", "eng", ENG_JPEG_LINES, img.size)

    img = render(ENG_SHORT_LINES, font_path, 40, 40, 24)
    save(img, os.path.join(out, "eng.tif"), "TIFF")
    add("eng.tif", "tiff", "eng", ENG_SHORT_LINES, img.size)
    save(img, os.path.join(out, "eng.bmp"), "BMP")
    add("eng.bmp", "bmp", "eng", ENG_SHORT_LINES, img.size)
    save(img, os.path.join(out, "eng.pnm"), "PPM")
    add("eng.pnm", "pnm", "eng", ENG_SHORT_LINES, img.size)

    img = render(VIE_LINES, font_path, 44, 40, 30)
    save(img, os.path.join(out, "vie.png"), "PNG")
    add("vie.png", "png", "vie", VIE_LINES, img.size)

    size = save_large(os.path.join(out, "large.png"), font_path)
    add("large.png", "png", "eng", LARGE_LINES, size)

    manifest = dict(stamp=stamp(), images=entries)
    path = os.path.join(out, "manifest.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(manifest, f, ensure_ascii=False, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def up_to_date(out):
    path = os.path.join(out, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    if manifest.get("stamp") != stamp():
        return False
    return all(os.path.exists(os.path.join(out, e["file"])) for e in manifest.get("images", []))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="testdata/ocr", help="output directory")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = ap.parse_args(argv)
    if not args.force and up_to_date(args.out):
        print(f"make_ocr_images: {args.out} is up to date")
        return
    build(args.out, find_font())
    print(f"make_ocr_images: wrote {args.out}")


if __name__ == "__main__":
    main()
