"""The ImageNet TFRecord schema: the one place that knows feature names, types and the label convention.

The layout follows tensorflow/tpu's imagenet_to_gcs converter so that shards written by either tool are read by
both. Labels on disk are 1-based (1..1000); label 0 is the "background" class of the 1001-class convention. The
model's class count and the on-disk offset are explicit settings (``num_classes``, ``label_offset``) and
``to_model_label`` is the only function that applies the offset.

Shard files are named ``{split}-{index:05d}-of-{count:05d}`` (``train-00000-of-01024``).
"""

import os
from typing import Iterable, NamedTuple, Sequence

import tensorflow as tf

TRAIN = 'train'
VALIDATION = 'validation'

# Feature keys.
ENCODED = 'image/encoded'
FORMAT = 'image/format'
LABEL = 'image/class/label'
SYNSET = 'image/class/synset'
HEIGHT = 'image/height'
WIDTH = 'image/width'
FILENAME = 'image/filename'
BBOX_KEYS = ('image/object/bbox/xmin', 'image/object/bbox/ymin', 'image/object/bbox/xmax',
             'image/object/bbox/ymax')

# What the input pipeline parses. Variable-length boxes; everything else is a scalar.
FEATURE_SPEC = {
    ENCODED: tf.io.FixedLenFeature([], tf.string),
    FORMAT: tf.io.FixedLenFeature([], tf.string, default_value='jpeg'),
    LABEL: tf.io.FixedLenFeature([], tf.int64),
    SYNSET: tf.io.FixedLenFeature([], tf.string, default_value=''),
    HEIGHT: tf.io.FixedLenFeature([], tf.int64, default_value=0),
    WIDTH: tf.io.FixedLenFeature([], tf.int64, default_value=0),
    FILENAME: tf.io.FixedLenFeature([], tf.string, default_value=''),
    **{key: tf.io.VarLenFeature(tf.float32) for key in BBOX_KEYS},
}


class Box(NamedTuple):
    """A bounding box in coordinates relative to the image size, each in [0, 1]."""
    xmin: float
    ymin: float
    xmax: float
    ymax: float


def shard_name(split: str, index: int, count: int) -> str:
    return f'{split}-{index:05d}-of-{count:05d}'


def file_pattern(data_dir: str, split: str) -> str:
    return os.path.join(data_dir, f'{split}-*-of-*')


def _bytes(values: Iterable[bytes]) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=list(values)))


def _ints(values: Iterable[int]) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))


def _floats(values: Iterable[float]) -> tf.train.Feature:
    return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))


def make_example(encoded: bytes, label: int, height: int, width: int, *, synset: str = '',
                 filename: str = '', image_format: str = 'JPEG',
                 boxes: Sequence[Box] = ()) -> tf.train.Example:
    """One record. ``label`` is the on-disk label (1-based for ImageNet); ``boxes`` are relative coordinates."""
    feature = {
        ENCODED: _bytes([encoded]),
        FORMAT: _bytes([image_format.encode()]),
        LABEL: _ints([label]),
        SYNSET: _bytes([synset.encode()]),
        HEIGHT: _ints([height]),
        WIDTH: _ints([width]),
        FILENAME: _bytes([filename.encode()]),
    }
    for index, key in enumerate(BBOX_KEYS):
        feature[key] = _floats([box[index] for box in boxes])
    return tf.train.Example(features=tf.train.Features(feature=feature))


def parse_example(serialized: tf.Tensor) -> dict:
    """Parses one serialized record into a dict of dense tensors.

    Returns ``encoded`` (string scalar), ``label`` (int32 scalar, on-disk convention), ``boxes`` (float32
    [num_boxes, 4] as ymin, xmin, ymax, xmax, the order tf.image expects) and ``filename``.
    """
    features = tf.io.parse_single_example(serialized, FEATURE_SPEC)
    xmin, ymin, xmax, ymax = (tf.sparse.to_dense(features[key]) for key in BBOX_KEYS)
    return {
        'encoded': features[ENCODED],
        'label': tf.cast(features[LABEL], tf.int32),
        'boxes': tf.stack([ymin, xmin, ymax, xmax], axis=-1),
        'filename': features[FILENAME],
    }


def to_model_label(disk_label: tf.Tensor, label_offset: int, num_classes: int) -> tf.Tensor:
    """Maps an on-disk label to the model's class index in [0, num_classes), failing on anything outside.

    With ImageNet's 1..1000 on disk: label_offset=1, num_classes=1000 (or label_offset=0, num_classes=1001 for
    the 1001-class convention with an unused background class 0).
    """
    label = disk_label - label_offset
    check = tf.debugging.assert_equal(
        tf.logical_and(label >= 0, label < num_classes), True,
        message=(f'label out of range: expected on-disk labels in [{label_offset}, {label_offset + num_classes})'
                 f' (label_offset={label_offset}, num_classes={num_classes})'))
    with tf.control_dependencies([check]):
        return tf.identity(label)


def write_shard(path: str, examples: Iterable[tf.train.Example]) -> int:
    """Writes records to ``path`` atomically (temporary name, then rename); returns the record count.

    A shard that exists under its final name is therefore complete, which is what lets an interrupted
    conversion resume by skipping it.
    """
    temporary = path + '.incomplete'
    count = 0
    with tf.io.TFRecordWriter(temporary) as writer:
        for example in examples:
            writer.write(example.SerializeToString())
            count += 1
    tf.io.gfile.rename(temporary, path, overwrite=True)
    return count


def read_labels(path: str) -> list:
    """On-disk labels of every record in one shard, in order (used by tests and checks)."""
    return [int(parse_example(record)['label']) for record in tf.data.TFRecordDataset(path)]
