"""Writes an ImageNet-like benchmark set: photographic JPEGs of ImageNet's typical size and weight.

Input-pipeline speed depends on what is decoded: flat or random-noise images decode at unrealistic speeds, so
the images here are crops and rescales of real photographs shipped inside installed packages (scikit-learn's
china.jpg and flower.jpg, matplotlib's grace_hopper.jpg): each is a random crop of 30-100% of a photo, resized
to about 500x375 (or 375x500), flipped and colour-shifted at random, and JPEG-encoded at the quality that
brings it to 100-130 KB, as ImageNet's training images are (mean about 110 KB). Records use the project's
TFRecord writer, so every pipeline reads them like ImageNet shards.

    python tools/data/make_benchmark_data.py --output_dir data/benchmark --num_images 2000
"""

import io
import os
import time

import numpy as np

TARGET_BYTES = (100_000, 130_000)
QUALITIES = (95, 92, 97, 90, 98, 88, 85, 99, 80, 75)


def source_photos() -> list:
    """The real photographs found among the installed packages, as PIL RGB images."""
    from PIL import Image
    paths = []
    try:
        import sklearn.datasets
        folder = os.path.join(os.path.dirname(sklearn.datasets.__file__), 'images')
        paths += [os.path.join(folder, name) for name in ('china.jpg', 'flower.jpg')]
    except ImportError:
        pass
    try:
        import matplotlib
        paths.append(os.path.join(matplotlib.get_data_path(), 'sample_data', 'grace_hopper.jpg'))
    except ImportError:
        pass
    photos = [Image.open(path).convert('RGB') for path in paths if os.path.exists(path)]
    if not photos:
        raise SystemExit('error: no sample photographs found (install scikit-learn or matplotlib)')
    return photos


def make_image(photo, rng: np.random.Generator) -> bytes:
    """One JPEG of 100-130 KB (when any quality gets there) from a random crop of ``photo``."""
    from PIL import Image, ImageEnhance
    width, height = photo.size
    area = rng.uniform(0.3, 1.0) * width * height
    aspect = rng.uniform(0.75, 1.333)
    crop_w = int(min(width, (area * aspect) ** 0.5))
    crop_h = int(min(height, (area / aspect) ** 0.5))
    left, top = rng.integers(0, width - crop_w + 1), rng.integers(0, height - crop_h + 1)
    image = photo.crop((left, top, left + crop_w, top + crop_h))
    size = (500, 375) if rng.random() < 0.75 else (375, 500)
    image = image.resize((size[0] + int(rng.integers(-40, 41)), size[1] + int(rng.integers(-30, 31))),
                         Image.BICUBIC)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    image = ImageEnhance.Color(image).enhance(rng.uniform(0.7, 1.3))
    image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.8, 1.2))
    best = None
    for quality in QUALITIES:
        buffer = io.BytesIO()
        image.save(buffer, 'JPEG', quality=quality)
        encoded = buffer.getvalue()
        if TARGET_BYTES[0] <= len(encoded) <= TARGET_BYTES[1]:
            return encoded, image.size
        middle = sum(TARGET_BYTES) / 2
        if best is None or abs(len(encoded) - middle) < abs(len(best) - middle):
            best = encoded
    return best, image.size


def write(output_dir: str, num_images: int, num_shards: int, num_classes: int, seed: int, split: str = 'train',
          print_fn=print) -> dict:
    """Writes ``num_images`` records in ``num_shards`` shards; returns counts and byte statistics."""
    import tensorflow as tf  # noqa: F401  (the writer needs it)
    from imagenet_tpu.data import tfrecord
    photos = source_photos()
    rng = np.random.default_rng(seed)
    os.makedirs(output_dir, exist_ok=True)
    sizes, started = [], time.perf_counter()
    for shard in range(num_shards):
        examples = []
        for index in range(shard, num_images, num_shards):
            encoded, (width, height) = make_image(photos[index % len(photos)], rng)
            sizes.append(len(encoded))
            examples.append(tfrecord.make_example(encoded, index % num_classes + 1, height, width,
                                                  filename=f'{split}_{index:07d}.JPEG'))
        tfrecord.write_shard(os.path.join(output_dir, tfrecord.shard_name(split, shard, num_shards)), examples)
        done, elapsed = len(sizes), time.perf_counter() - started
        print_fn(f'shard {shard + 1}/{num_shards}: {done} images, {done / elapsed:.0f} images/s, '
                 f'ETA {(num_images - done) * elapsed / done:.0f} s')
    sizes = np.array(sizes)
    summary = {'images': int(len(sizes)), 'photos': len(photos), 'mean_bytes': float(sizes.mean()),
               'in_target': float(np.mean((sizes >= TARGET_BYTES[0]) & (sizes <= TARGET_BYTES[1])))}
    print_fn(f'wrote {summary["images"]} JPEGs from {summary["photos"]} photographs to {output_dir}: mean '
             f'{summary["mean_bytes"] / 1000:.0f} KB, {100 * summary["in_target"]:.0f}% within 100-130 KB')
    return summary


def main(argv):
    del argv
    write(_OUTPUT_DIR.value, _NUM_IMAGES.value, _NUM_SHARDS.value, _NUM_CLASSES.value, _SEED.value)
    if _NUM_VALIDATION_IMAGES.value:
        write(_OUTPUT_DIR.value, _NUM_VALIDATION_IMAGES.value, 1, _NUM_CLASSES.value, _SEED.value + 1,
              split='validation')
    from imagenet_tpu.data import record_counts
    record_counts.write_beside(_OUTPUT_DIR.value)


if __name__ == '__main__':
    from imagenet_tpu import runtime  # before TensorFlow: the package's oneDNN setting
    runtime.import_tensorflow()     # a quiet start (no CUDA-probe line without a GPU)
    from absl import app, flags
    _OUTPUT_DIR = flags.DEFINE_string('output_dir', 'data/benchmark', 'Where the shards are written.')
    _NUM_IMAGES = flags.DEFINE_integer('num_images', 2000, 'Images to write.')
    _NUM_VALIDATION_IMAGES = flags.DEFINE_integer('num_validation_images', 64, 'Images of a one-shard validation '
                                                  'split (0: none), which the training command needs.')
    _NUM_SHARDS = flags.DEFINE_integer('num_shards', 8, 'Shards to write them in.')
    _NUM_CLASSES = flags.DEFINE_integer('num_classes', 1000, 'Labels 1..num_classes, in turn.')
    _SEED = flags.DEFINE_integer('seed', 0, 'Seed of the crops, sizes and colours.')
    app.run(main)
