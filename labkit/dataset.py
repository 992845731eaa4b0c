"""A labelled image dataset made offline, with realistic JPEG cost.

The labs need images whose decode cost is like a real photo dataset's, without
downloading anything. Each image is a procedural shape (the label) drawn over a
crop of one of the two photographs scikit-learn ships, saved as a JPEG of a few
hundred pixels: the bytes on disk and the decode time per image are those of a
real dataset, and the label is known exactly.

Real datasets also carry junk. About one image in ten is deliberately degraded
(blurred, noisy, low resolution, overexposed) and every image gets a measured
quality score: the PSNR of the stored JPEG against its clean rendering, scaled to
0..1. Lab 2 filters on it.

Files are stored the way many real datasets are, one folder per class
(``images/<class>/<id>.jpg``), which matters for Lab 1's label-skew pitfall. The
catalog (``catalog.parquet``) is the Parquet metadata table the data-engine lab
starts from. The whole folder is written atomically, so an interrupted
generation leaves no half dataset behind.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter
from tqdm.auto import tqdm

from labkit.atomic import atomic_directory, remove_stale_temporaries
from labkit.paths import data_dir

FORMAT_VERSION = 1
CLASSES = (
    "circle", "square", "triangle", "diamond", "pentagon",
    "hexagon", "star", "cross", "ring", "arrow",
)
SIDES_PX = (160, 224, 288)
DEGRADATIONS = ("blur", "noise", "lowres", "overexposed")
DEGRADED_FRACTION = 0.1
JPEG_QUALITY = 90

SCHEMA = pa.schema([
    ("image_id", pa.int64()),
    ("path", pa.string()),
    ("label", pa.int64()),
    ("label_name", pa.string()),
    ("split", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("bytes", pa.int64()),
    ("quality", pa.float32()),
    ("degraded", pa.bool_()),
    ("degradation", pa.string()),
])


class DatasetError(ValueError):
    """The dataset is missing or damaged; the message says how to fix it."""


@dataclass(frozen=True)
class Dataset:
    name: str
    root: Path
    catalog_path: Path
    num_images: int

    def catalog(self) -> pa.Table:
        return pq.read_table(self.catalog_path)

    def paths_and_labels(self, split: str | None = None) -> tuple[list[str], list[int]]:
        table = self.catalog()
        paths, labels, splits = (table.column(c).to_pylist() for c in ("path", "label", "split"))
        keep = [i for i, s in enumerate(splits) if split is None or s == split]
        return [paths[i] for i in keep], [labels[i] for i in keep]


def default_name(num_images: int, seed: int) -> str:
    return f"shapes-{num_images}" + (f"-seed{seed}" if seed else "")


def generate(
    num_images: int,
    *,
    name: str | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> Dataset:
    """Make (or reuse) the dataset; calling it twice with the same arguments is free."""
    if num_images < len(CLASSES):
        raise ValueError(f"num_images must be >= {len(CLASSES)} (one per class), got {num_images}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    name = name or default_name(num_images, seed)
    root = data_dir() / name
    remove_stale_temporaries(root.parent)
    config = {"version": FORMAT_VERSION, "num_images": num_images, "seed": seed}
    if root.exists() and not overwrite:
        existing = load(name)
        if _read_manifest(root).get("config") == config:
            return existing
        raise DatasetError(
            f"{root} holds a different dataset ({_read_manifest(root).get('config')}); "
            f"pass overwrite=True or another name="
        )
    with atomic_directory(root) as tmp:
        rows = _render_all(tmp, root, num_images, seed, progress)
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp / "catalog.parquet")
        manifest = {"config": config, "num_images": num_images, "total_bytes": sum(r["bytes"] for r in rows)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return load(name)


def load(name: str) -> Dataset:
    """Open a generated dataset, checking that it is complete."""
    root = data_dir() / name
    fix = f"call labkit.dataset.generate(...) (or delete {root} and regenerate)"
    if not (root / "manifest.json").exists():
        raise DatasetError(f"no dataset at {root}: {fix}")
    manifest = _read_manifest(root)
    try:
        table = pq.read_table(root / "catalog.parquet", columns=["path", "bytes"])
    except Exception as exc:  # noqa: BLE001 - any read failure means a damaged catalog
        raise DatasetError(f"catalog of {root} is unreadable ({exc}): {fix}") from exc
    if table.num_rows != manifest.get("num_images"):
        raise DatasetError(f"catalog of {root} has {table.num_rows} rows, manifest says {manifest.get('num_images')}: {fix}")
    for path, size in zip(table.column("path").to_pylist(), table.column("bytes").to_pylist()):
        if not Path(path).is_file() or Path(path).stat().st_size != size:
            raise DatasetError(f"image {path} is missing or has the wrong size: {fix}")
    return Dataset(name=name, root=root, catalog_path=root / "catalog.parquet", num_images=table.num_rows)


def _read_manifest(root: Path) -> dict:
    try:
        return json.loads((root / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"manifest of {root} is unreadable ({exc}): delete {root} and regenerate") from exc


@lru_cache(maxsize=1)
def _photos() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(load_sample_images().images)


def _render_all(tmp: Path, final_root: Path, num_images: int, seed: int, progress: bool) -> list[dict]:
    rng = np.random.default_rng(seed)
    labels = np.arange(num_images) % len(CLASSES)
    rng.shuffle(labels)
    degraded = rng.random(num_images) < DEGRADED_FRACTION
    rows = []
    for image_id in tqdm(range(num_images), desc=f"generating {num_images} images", disable=not progress):
        label = int(labels[image_id])
        degradation = DEGRADATIONS[rng.integers(len(DEGRADATIONS))] if degraded[image_id] else "none"
        clean = render_image(rng, label)
        stored = degrade(clean, degradation, rng)
        data = encode_jpeg(stored)
        relative = Path("images") / CLASSES[label] / f"{image_id:06d}.jpg"
        (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp / relative).write_bytes(data)
        rows.append({
            "image_id": image_id,
            "path": str(final_root / relative),
            "label": label,
            "label_name": CLASSES[label],
            "split": split_of(image_id, seed),
            "width": stored.width,
            "height": stored.height,
            "bytes": len(data),
            "quality": quality_score(clean, data),
            "degraded": degradation != "none",
            "degradation": degradation,
        })
    return rows


def split_of(image_id: int, seed: int) -> str:
    """80/10/10 by a hash of the id: stable when the dataset grows."""
    bucket = (image_id * 2654435761 + seed) % 10
    return "train" if bucket < 8 else ("val" if bucket == 8 else "test")


def side_for(label: int, rng: np.random.Generator) -> int:
    """Image size correlates with class (as in real collections, where sources differ by class)."""
    offset = 0 if rng.random() < 0.8 else int(rng.integers(1, len(SIDES_PX)))
    return SIDES_PX[(label + offset) % len(SIDES_PX)]


def render_image(rng: np.random.Generator, label: int) -> Image.Image:
    side = side_for(label, rng)
    photo = _photos()[rng.integers(len(_photos()))]
    top = int(rng.integers(0, photo.shape[0] - side))
    left = int(rng.integers(0, photo.shape[1] - side))
    image = Image.fromarray(photo[top:top + side, left:left + side])
    draw = ImageDraw.Draw(image)
    centre = rng.uniform(0.35, 0.65, size=2) * side
    radius = rng.uniform(0.18, 0.32) * side
    colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
    _draw_shape(draw, CLASSES[label], centre, radius, float(rng.uniform(0, 2 * math.pi)), colour)
    return image


def _polygon(centre: np.ndarray, radii: list[float], angle: float) -> list[tuple[float, float]]:
    count = len(radii)
    return [
        (centre[0] + r * math.cos(angle + 2 * math.pi * k / count), centre[1] + r * math.sin(angle + 2 * math.pi * k / count))
        for k, r in enumerate(radii)
    ]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, c: np.ndarray, r: float, a: float, colour: tuple) -> None:
    box = [c[0] - r, c[1] - r, c[0] + r, c[1] + r]
    width = max(2, int(r / 4))
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=width)
    elif shape == "cross":
        draw.line(_polygon(c, [r, r], a), fill=colour, width=width)
        draw.line(_polygon(c, [r, r], a + math.pi / 2), fill=colour, width=width)
    elif shape == "arrow":
        tip, tail = _polygon(c, [r, r], a)
        draw.line([tip, tail], fill=colour, width=width)
        draw.polygon(_polygon(np.array(tip), [r / 2] * 3, a), fill=colour)
    elif shape == "star":
        draw.polygon(_polygon(c, [r, r / 2.5] * 5, a), fill=colour)
    else:
        sides = {"square": 4, "triangle": 3, "diamond": 4, "pentagon": 5, "hexagon": 6}[shape]
        turn = math.pi / 4 if shape == "square" else 0.0
        draw.polygon(_polygon(c, [r] * sides, a + turn if shape != "diamond" else 0.0), fill=colour)


def degrade(image: Image.Image, degradation: str, rng: np.random.Generator) -> Image.Image:
    if degradation == "none":
        return image
    if degradation == "blur":
        return image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(3, 6))))
    if degradation == "noise":
        noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, 45, size=(image.height, image.width, 3))
        return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    if degradation == "lowres":
        small = image.resize((image.width // 8, image.height // 8), Image.BILINEAR)
        return small.resize(image.size, Image.NEAREST)
    if degradation == "overexposed":
        return ImageEnhance.Brightness(image).enhance(float(rng.uniform(2.5, 3.5)))
    raise ValueError(f"degradation must be one of {('none',) + DEGRADATIONS}, got {degradation!r}")


def encode_jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def quality_score(clean: Image.Image, stored_jpeg: bytes) -> float:
    """PSNR of the stored JPEG against the clean rendering, mapped from 10..40 dB to 0..1."""
    stored = np.asarray(Image.open(io.BytesIO(stored_jpeg)).convert("RGB"), dtype=np.float32)
    mse = float(np.mean((stored - np.asarray(clean, dtype=np.float32)) ** 2))
    psnr = 10 * math.log10(255.0**2 / max(mse, 1e-6))
    return float(np.clip((psnr - 10.0) / 30.0, 0.0, 1.0))
