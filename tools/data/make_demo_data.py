"""Writes the demo dataset: scikit-learn's 1,797 handwritten digits as ImageNet-format TFRecord shards.

The 8x8 scans (16 grey levels) are upsampled to --image_size pixels, made RGB, JPEG-encoded and written by the
same writer as the ImageNet converter, with on-disk labels 1..10 (the ImageNet convention: label_offset=1).
The train/validation split is fixed by --seed, so every run of the demo sees the same held-out images. The
class names (zero ... nine) go to labels.txt beside the shards.

    python tools/data/make_demo_data.py --output_dir data/demo
"""

import os

from absl import app, flags
import numpy as np

_OUTPUT_DIR = flags.DEFINE_string('output_dir', 'data/demo', 'Where the shards are written.')
_IMAGE_SIZE = flags.DEFINE_integer('image_size', 32, 'Side of the stored JPEGs, in pixels.')
_VALIDATION_FRACTION = flags.DEFINE_float('validation_fraction', 0.2, 'Share of the images held out.')
_TRAIN_SHARDS = flags.DEFINE_integer('train_shards', 8, 'Number of training shards.')
_VALIDATION_SHARDS = flags.DEFINE_integer('validation_shards', 2, 'Number of validation shards.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the train/validation split.')

DIGIT_NAMES = ('zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine')


def digit_images(image_size: int):
    """(uint8 RGB images [n, size, size, 3], digits [n]) from scikit-learn's bundled scans."""
    from sklearn.datasets import load_digits
    import tensorflow as tf
    digits = load_digits()
    scans = digits.images.astype(np.float32)[..., np.newaxis] * (255.0 / 16.0)  # 0..16 grey levels -> 0..255
    images = tf.image.resize(scans, [image_size, image_size], method='bilinear').numpy()
    images = np.repeat(np.clip(np.round(images), 0, 255).astype(np.uint8), 3, axis=-1)
    return images, digits.target.astype(np.int64)


def write_split(output_dir: str, split: str, images, digits, num_shards: int) -> None:
    import tensorflow as tf
    from imagenet_tpu.data import tfrecord
    for shard in range(num_shards):
        indexes = range(shard, len(images), num_shards)
        examples = (tfrecord.make_example(
            tf.io.encode_jpeg(images[i], quality=95).numpy(), int(digits[i]) + 1, images[i].shape[0],
            images[i].shape[1], synset=f'digit{digits[i]}', filename=f'digit_{split}_{i:05d}.JPEG')
            for i in indexes)
        tfrecord.write_shard(os.path.join(output_dir, tfrecord.shard_name(split, shard, num_shards)), examples)


def main(argv):
    del argv
    images, digits = digit_images(_IMAGE_SIZE.value)
    order = np.random.default_rng(_SEED.value).permutation(len(images))
    held_out = int(round(len(images) * _VALIDATION_FRACTION.value))
    validation, train = order[:held_out], order[held_out:]
    os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
    write_split(_OUTPUT_DIR.value, 'train', images[train], digits[train], _TRAIN_SHARDS.value)
    write_split(_OUTPUT_DIR.value, 'validation', images[validation], digits[validation], _VALIDATION_SHARDS.value)
    from imagenet_tpu.data import labels
    from imagenet_tpu.data import record_counts
    record_counts.write_beside(_OUTPUT_DIR.value)
    labels.write(labels.path_in(_OUTPUT_DIR.value),
                 [labels.Label(digit + 1, f'digit{digit}', name) for digit, name in enumerate(DIGIT_NAMES)])
    print(f'wrote {len(train)} training and {len(validation)} validation digits ({_IMAGE_SIZE.value}x'
          f'{_IMAGE_SIZE.value} JPEG, labels 1..10) to {_OUTPUT_DIR.value}')


if __name__ == '__main__':
    from imagenet_tpu import runtime  # before TensorFlow: the package's oneDNN setting
    runtime.import_tensorflow()     # a quiet start (no CUDA-probe line without a GPU)
    app.run(main)
