"""The ImageNet TFRecord schema: the one place that knows feature names, types and the label convention.

The layout follows tensorflow/tpu's imagenet_to_gcs converter so that shards written by either tool are read by
both. Labels on disk are 1-based (1..1000); label 0 is the "background" class of the 1001-class convention. The
model's class count and the on-disk offset are explicit settings (``num_classes``, ``label_offset``) and
``to_model_label`` is the only function that applies the offset.

Shard files are named ``{split}-{index:05d}-of-{count:05d}`` (``train-00000-of-01024``).

The other layout read in place is tensorflow_datasets' (``imagenet2012`` prepared with ``file_format='tfrecord'``,
its default): a folder with ``dataset_info.json`` and shards such as ``imagenet2012-train.tfrecord-00000-of-01024``
whose records hold the encoded image and a 0-based label under the dataset's supervised keys (``image``,
``label``). ``layout_of`` tells the two apart by ``dataset_info.json``. A TFDS label l is read as on-disk label
l + 1, the 1-based convention of the shards above (TFDS numbers ImageNet's classes in the same sorted-synset order),
so ``label_offset`` and every recipe mean the same on either layout.
"""

import functools
import json
import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from imagenet_tpu.errors import DataError

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


TFDS_INFO = 'dataset_info.json'
TFDS_TEMPLATE = '{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}'   # tensorflow_datasets' default file names


class Layout(NamedTuple):
    """How a data_dir names its shards and what their records hold: tensorflow/tpu's schema (``tfds`` False) or a
    tensorflow_datasets folder (its name, image and label features, file names and record counts per split)."""
    tfds: bool = False
    name: str = ''
    image_key: str = 'image'
    label_key: str = 'label'
    file_format: str = 'tfrecord'
    templates: Optional[Dict[str, str]] = None          # split -> file name template
    shard_lengths: Optional[Dict[str, List[int]]] = None  # split -> records of each shard

    def shard_names(self, split: str) -> Dict[str, int]:
        """{file name: records} of ``split`` as dataset_info.json gives them (empty for tensorflow/tpu's schema)."""
        if not self.tfds or split not in (self.shard_lengths or {}):
            return {}
        lengths = self.shard_lengths[split]
        return {self._file_name(split, f'{index:05d}-of-{len(lengths):05d}'): count
                for index, count in enumerate(lengths)}

    def _file_name(self, split: str, shard: str) -> str:
        template = (self.templates or {}).get(split) or TFDS_TEMPLATE
        return (template.replace('{DATASET}', self.name).replace('{SPLIT}', split)
                .replace('{FILEFORMAT}', self.file_format).replace('{SHARD_X_OF_Y}', shard))

    def pattern(self, data_dir: str, split: str) -> str:
        """The glob of ``split``'s shards in ``data_dir``."""
        if self.tfds:
            return os.path.join(data_dir, self._file_name(split, '*-of-*'))
        return os.path.join(data_dir, f'{split}-*-of-*')

    def parse(self, serialized: tf.Tensor) -> dict:
        """parse_example for this layout."""
        if not self.tfds:
            return parse_example(serialized)
        features = tf.io.parse_single_example(serialized, {
            self.image_key: tf.io.FixedLenFeature([], tf.string),
            self.label_key: tf.io.FixedLenFeature([], tf.int64),
            'file_name': tf.io.FixedLenFeature([], tf.string, default_value='')})
        return {'encoded': features[self.image_key],
                'label': tf.cast(features[self.label_key], tf.int32) + 1,   # 0-based -> tensorflow/tpu's 1-based
                'boxes': tf.zeros([0, 4]),
                'filename': features['file_name']}

    def label_parser(self, batched: bool = False):
        """A traced function: one serialized record -> its on-disk label (int32), as ``parse`` reads it, or with
        ``batched`` a vector of records -> their labels. Traced once per layout kind, so reading many labels costs
        one call (or one call a batch) instead of parse's eager ops (~8 ms a record)."""
        return _label_parser(self.tfds, self.image_key, self.label_key, batched)

    def class_names_path(self, data_dir: str) -> Optional[str]:
        """tensorflow_datasets' class-name file of the label feature (one name per line, label 0 first)."""
        return os.path.join(data_dir, f'{self.label_key}.labels.txt') if self.tfds else None


IMAGENET_LAYOUT = Layout()


@functools.lru_cache(maxsize=8)
def _label_parser(tfds: bool, image_key: str, label_key: str, batched: bool):
    layout = Layout(tfds=tfds, image_key=image_key, label_key=label_key)
    if batched:
        return tf.function(lambda serialized: tf.map_fn(lambda one: layout.parse(one)['label'], serialized,
                                                        fn_output_signature=tf.int32),
                           input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
    return tf.function(lambda serialized: layout.parse(serialized)['label'],
                       input_signature=[tf.TensorSpec([], tf.string)], autograph=False)


def layout_of(data_dir: Optional[str]) -> Layout:
    """The Layout of ``data_dir``: tensorflow_datasets' when it holds dataset_info.json, else tensorflow/tpu's.
    A dataset_info.json that cannot be used (not JSON, another file format) is a DataError naming it."""
    if not data_dir:
        return IMAGENET_LAYOUT
    return _layout_of(data_dir)


@functools.lru_cache(maxsize=16)
def _layout_of(data_dir: str) -> Layout:
    path = os.path.join(data_dir, TFDS_INFO)
    if not tf.io.gfile.exists(path):
        return IMAGENET_LAYOUT
    try:
        with tf.io.gfile.GFile(path) as f:
            info = json.load(f)
        splits = {split['name']: split for split in info.get('splits', [])}
        keys = [item['featureKey'] for item in info.get('supervisedKeys', {}).get('tuple', {}).get('items', [])]
        layout = Layout(
            tfds=True, name=str(info['name']), file_format=str(info.get('fileFormat') or 'tfrecord'),
            image_key=keys[0] if len(keys) == 2 else 'image', label_key=keys[1] if len(keys) == 2 else 'label',
            templates={name: split.get('filepathTemplate') or TFDS_TEMPLATE for name, split in splits.items()},
            shard_lengths={name: [int(count) for count in split.get('shardLengths', [])]
                           for name, split in splits.items()})
    except (ValueError, KeyError, TypeError, AttributeError, tf.errors.OpError) as error:
        raise DataError(f'{path} is not a usable tensorflow_datasets dataset_info.json '
                        f'({type(error).__name__}: {error})') from None
    if layout.file_format != 'tfrecord':
        raise DataError(f'{path}: tensorflow_datasets prepared this dataset as {layout.file_format}; only its '
                        "tfrecord files are read (prepare it with file_format='tfrecord', TFDS's default)")
    return layout


def file_pattern(data_dir: str, split: str) -> str:
    return layout_of(data_dir).pattern(data_dir, split)


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
    layout = layout_of(os.path.dirname(path))
    return [int(label) for batch in tf.data.TFRecordDataset(path).batch(1024)
            for label in layout.label_parser(batched=True)(batch).numpy()]
