"""The evaluation input: every validation image once, in full batches padded with zero-weight images, shared
between the hosts; and the representative images an int8 conversion calibrates on. Training's input is
input_pipeline.py's.
"""

from typing import Callable, Optional

import tensorflow as tf

from imagenet_tpu.config import Config
from imagenet_tpu.data import input_pipeline, preprocessing, record_counts, record_io, tfrecord
from imagenet_tpu.data.record_io import SkipCounts
from imagenet_tpu.files import is_local


@record_io.traced_as_written
def eval_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                 dtype: Optional[tf.DType] = None, skip_counts: Optional[SkipCounts] = None) -> tf.data.Dataset:
    """Exactly config.eval_steps full batches of (images, labels, weights) per replica, in file order.

    Every validation image appears once with weight 1; the batches are then filled with zero images of
    weight 0, so every replica gets a full batch at every step (TPUs need static shapes, and no replica
    waits on an empty one) and top-1 = sum(weight * correct) / sum(weight) is over the real images only.
    With several input pipelines (hosts), pipeline p takes records p, p + P, ... of all files in order, so the
    shares differ by at most one image and config.eval_steps_for(P) steps cover the largest: files are read
    by every host, but only its own records are decoded. (Sharding by file would give hosts unequal shares
    whose sizes are unknown without reading them.)
    """
    dtype = dtype or input_pipeline.image_dtype(config)
    paths = record_io.list_shards(config.data_dir, tfrecord.VALIDATION)
    bad, truncated = (skip_counts or SkipCounts()).new_counters()
    # Local files cut mid-record are found from their length fields before reading: counted while reading, a
    # cut at the very end goes uncounted whenever the real images fill the last batch (nothing reads past
    # them). Remote files (gs://...) are counted while reading.
    local = all(is_local(path) for path in paths)
    if local and config.bad_records == 'skip':
        with tf.init_scope():
            truncated.assign_add(sum(not record_counts.scan_file(path)[1] for path in paths))
    records = record_io.read_records(paths, record_io.file_sizes(paths), cycle_length=1,
                                     truncated=None if local else truncated, deterministic=True,
                                     **input_pipeline.reader_settings(config))
    num_pipelines = context.num_input_pipelines if context else 1
    if num_pipelines > 1:
        records = records.shard(num_pipelines, context.input_pipeline_id)

    layout = tfrecord.layout_of(config.data_dir)

    def parse(index, serialized):
        example = layout.parse(serialized)
        image = eval_preprocessing(layout)(example['encoded'], config.image_size, dtype=dtype,
                                                  crop_fraction=config.eval_crop,
                                                  resize_method=config.resize_method)
        label = tfrecord.to_model_label(example['label'], config.label_offset, config.num_classes)
        return index, image, label, tf.constant(1.0)

    read = SkipCounts.position_counter()
    examples = record_io.decode_guarded(
        record_io.enumerate_records(records, read).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True),
        bad if config.bad_records == 'skip' else None, read)
    padding = tf.data.Dataset.from_tensors(
        (tf.zeros([config.image_size, config.image_size, 3], dtype), tf.constant(0), tf.constant(0.0))).repeat()
    replicas_per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines if context else 1
    batches = examples.concatenate(padding)
    batches = batches.batch(input_pipeline.per_replica_batch(config.eval_batch_size, context), drop_remainder=True)
    batches = batches.take(config.eval_steps_for(num_pipelines) * replicas_per_pipeline)
    batches = input_pipeline.space_to_depth(batches, config).prefetch(tf.data.AUTOTUNE)
    return batches.with_options(input_pipeline.dataset_options(deterministic=True))


def eval_preprocessing(layout: tfrecord.Layout) -> Callable:
    """The evaluation preprocessing of a layout's images: JPEG only in our shards (the converter re-encodes the
    rest), any of JPEG, PNG, GIF, BMP in tensorflow_datasets' (which stores images given as arrays as PNG)."""
    return preprocessing.preprocess_any_for_eval if layout.tfds else preprocessing.preprocess_for_eval


@record_io.traced_as_written
def calibration_dataset(config: Config, count: int) -> tf.data.Dataset:
    """``count`` training images (fewer if the shards hold fewer), float32 [image_size, image_size, 3] with the
    evaluation preprocessing and no augmentation, drawn from every training file in turn, bad records skipped:
    the representative set an int8 conversion calibrates its activation ranges on."""
    paths = record_io.list_shards(config.data_dir, tfrecord.TRAIN)
    layout = tfrecord.layout_of(config.data_dir)
    records = tf.data.Dataset.from_tensor_slices(paths).interleave(
        tf.data.TFRecordDataset, cycle_length=len(paths), block_length=1)

    def parse(serialized):
        return eval_preprocessing(layout)(layout.parse(serialized)['encoded'], config.image_size,
                                                 dtype=tf.float32, crop_fraction=config.eval_crop,
                                                 resize_method=config.resize_method)

    return records.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors().take(count)
