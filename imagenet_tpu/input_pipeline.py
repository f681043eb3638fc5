"""tf.data pipelines from TFRecord shards to per-replica batches of (images, labels).

Each function that builds a dataset takes a tf.distribute.InputContext, so that
``strategy.distribute_datasets_from_function`` builds one pipeline per host, each reading its own subset of the
files and batching at the per-replica batch size. Without a strategy, pass no context.
"""

import os
from typing import Optional

import tensorflow as tf

from imagenet_tpu import preprocessing, tfrecord
from imagenet_tpu.config import Config, ConfigError

AUTOTUNE = tf.data.AUTOTUNE
INTERLEAVE_CYCLE_LENGTH = 16      # files read at once per pipeline


def list_shards(data_dir: Optional[str], split: str) -> list:
    """Sorted shard paths of ``split`` in ``data_dir``; ConfigError when there are none."""
    if not data_dir:
        raise ConfigError('--data_dir is not set (or pass --synthetic_data for a run without input)')
    if not tf.io.gfile.isdir(data_dir):
        raise ConfigError(f'--data_dir {data_dir} does not exist or is not a directory')
    paths = sorted(tf.io.gfile.glob(tfrecord.file_pattern(data_dir, split)))
    if not paths:
        pattern = os.path.basename(tfrecord.file_pattern(data_dir, split))
        raise ConfigError(f'no {split} files matching {pattern} in --data_dir {data_dir}')
    return paths


def check_labels(path: str, config: Config, records: int = 64) -> None:
    """Reads the first ``records`` labels of a shard and fails at start if any is outside the model's range."""
    low, high = config.label_offset, config.label_offset + config.num_classes
    for record in tf.data.TFRecordDataset(path).take(records):
        label = int(tfrecord.parse_example(record)['label'])
        if not low <= label < high:
            raise ConfigError(
                f'{path}: on-disk label {label} is outside [{low}, {high}) given --num_classes={config.num_classes}'
                f' and --label_offset={config.label_offset} (ImageNet shards store 1..1000: num_classes=1000,'
                ' label_offset=1)')


def dataset_options(deterministic: bool) -> tf.data.Options:
    """The tf.data options every pipeline of ours uses (one place)."""
    options = tf.data.Options()
    options.deterministic = deterministic
    options.autotune.enabled = True
    options.experimental_optimization.map_parallelization = True
    return options


def _per_replica_batch(global_batch: int, context: Optional[tf.distribute.InputContext]) -> int:
    return context.get_per_replica_batch_size(global_batch) if context else global_batch


def _shard_files(paths: list, context: Optional[tf.distribute.InputContext]) -> tf.data.Dataset:
    files = tf.data.Dataset.from_tensor_slices(paths)
    if context and context.num_input_pipelines > 1:
        files = files.shard(context.num_input_pipelines, context.input_pipeline_id)
    return files


def train_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                  dtype: Optional[tf.DType] = None) -> tf.data.Dataset:
    """Endless shuffled training batches: images [per_replica_batch, size, size, 3] ``dtype`` (default
    image_dtype(config)), labels int32."""
    dtype = dtype or image_dtype(config)
    paths = list_shards(config.data_dir, tfrecord.TRAIN)
    files = _shard_files(paths, context).shuffle(len(paths), seed=config.seed).repeat()
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=min(INTERLEAVE_CYCLE_LENGTH, len(paths)),
                               block_length=1, num_parallel_calls=AUTOTUNE, deterministic=False)
    records = records.shuffle(config.shuffle_buffer, seed=config.seed)

    def parse(serialized):
        example = tfrecord.parse_example(serialized)
        image = preprocessing.preprocess_for_train(
            example['encoded'], example['boxes'], config.image_size, min_area=config.random_crop_min_area,
            flip=config.random_flip, dtype=dtype)
        return image, tfrecord.to_model_label(example['label'], config.label_offset, config.num_classes)

    batches = records.map(parse, num_parallel_calls=AUTOTUNE)
    batches = batches.batch(_per_replica_batch(config.global_batch_size, context), drop_remainder=True)
    return _finish(batches, config).with_options(dataset_options(deterministic=False))


def image_dtype(config: Config) -> tf.DType:
    """The dtype images leave the pipeline in: bfloat16 when the model computes in bfloat16."""
    return tf.bfloat16 if config.precision == 'mixed_bfloat16' else tf.float32


def _finish(batches: tf.data.Dataset, config: Config) -> tf.data.Dataset:
    """Space-to-depth on whole batches when the model's stem expects it (cheaper than per image), then prefetch."""
    if config.space_to_depth:
        batches = batches.map(lambda images, *rest: (tf.nn.space_to_depth(images, 2), *rest),
                              num_parallel_calls=AUTOTUNE)
    return batches.prefetch(AUTOTUNE)


def eval_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                 dtype: Optional[tf.DType] = None) -> tf.data.Dataset:
    """Exactly config.eval_steps full batches of (images, labels, weights) per replica, in file order.

    Every validation image appears once with weight 1; the batches are then filled with zero images of
    weight 0, so every replica gets a full batch at every step (TPUs need static shapes, and no replica
    waits on an empty one) and top-1 = sum(weight * correct) / sum(weight) is over the real images only.
    With several input pipelines (hosts), pipeline p takes records p, p + P, ... of all files in order, so the
    shares differ by at most one image and config.eval_steps_for(P) steps cover the largest: files are read
    by every host, but only its own records are decoded. (Sharding by file would give hosts unequal shares
    whose sizes are unknown without reading them.)
    """
    dtype = dtype or image_dtype(config)
    paths = list_shards(config.data_dir, tfrecord.VALIDATION)
    records = tf.data.Dataset.from_tensor_slices(paths).interleave(
        tf.data.TFRecordDataset, cycle_length=1, num_parallel_calls=AUTOTUNE, deterministic=True)
    num_pipelines = context.num_input_pipelines if context else 1
    if num_pipelines > 1:
        records = records.shard(num_pipelines, context.input_pipeline_id)

    def parse(serialized):
        example = tfrecord.parse_example(serialized)
        image = preprocessing.preprocess_for_eval(example['encoded'], config.image_size, dtype=dtype)
        label = tfrecord.to_model_label(example['label'], config.label_offset, config.num_classes)
        return image, label, tf.constant(1.0)

    padding = tf.data.Dataset.from_tensors(
        (tf.zeros([config.image_size, config.image_size, 3], dtype), tf.constant(0), tf.constant(0.0))).repeat()
    replicas_per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines if context else 1
    batches = records.map(parse, num_parallel_calls=AUTOTUNE).concatenate(padding)
    batches = batches.batch(_per_replica_batch(config.eval_batch_size, context), drop_remainder=True)
    batches = batches.take(config.eval_steps_for(num_pipelines) * replicas_per_pipeline)
    return _finish(batches, config).with_options(dataset_options(deterministic=True))


def synthetic_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                      dtype: Optional[tf.DType] = None) -> tf.data.Dataset:
    """One fixed random batch repeated forever: measures the model without any input cost."""
    dtype = dtype or image_dtype(config)
    batch = _per_replica_batch(config.global_batch_size, context)
    images = tf.random.stateless_normal([batch, config.image_size, config.image_size, 3], seed=[0, 1], dtype=dtype)
    if config.space_to_depth:
        images = tf.nn.space_to_depth(images, 2)
    labels = tf.random.stateless_uniform([batch], seed=[0, 2], maxval=config.num_classes, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(dataset_options(False))
