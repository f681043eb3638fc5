"""The evaluation input: every validation image once, in full batches padded with zero-weight images, shared
between the hosts; and the representative images an int8 conversion calibrates on. Training's input is
input_pipeline.py's.
"""

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from imagenet_tpu.config import Config
from imagenet_tpu.data import input_pipeline, preprocessing, record_counts, record_io, tfrecord
from imagenet_tpu.data.record_io import SkipCounts
from imagenet_tpu.files import is_local


def file_shares(records_per_file: Sequence[int], num_pipelines: int) -> List[List[int]]:
    """The validation files (indices) each of ``num_pipelines`` input pipelines reads: the largest file first to
    the pipeline with the fewest records so far (the lowest id on a tie), so the shares of records differ by at
    most the largest file; each share in file order. Every host computes the same shares from the same counts."""
    shares, totals = [[] for _ in range(num_pipelines)], [0] * num_pipelines
    for index in sorted(range(len(records_per_file)), key=lambda i: (-records_per_file[i], i)):
        pipeline = min(range(num_pipelines), key=lambda p: (totals[p], p))
        shares[pipeline].append(index)
        totals[pipeline] += records_per_file[index]
    return [sorted(share) for share in shares]


class ValidationSplit(NamedTuple):
    """How the validation files are shared by ``num_pipelines`` input pipelines: ``shares`` (file indices per
    pipeline; None: every pipeline reads every file and keeps every num_pipelines-th record, the fallback with
    fewer files than pipelines) and ``steps``, the evaluation steps that cover the largest share."""
    paths: Tuple[str, ...]
    shares: Optional[Tuple[Tuple[int, ...], ...]]
    steps: int


@functools.lru_cache(maxsize=16)
def validation_split(config: Config, num_pipelines: int) -> ValidationSplit:
    """The validation split for ``num_pipelines`` hosts. With at least as many files as hosts each host reads
    only its own files, about 1/hosts of the bytes (files shared by record counts: record_counts.py, from the
    files' length fields or the counts file beside remote shards); else each host reads every file and decodes
    every num_pipelines-th record (config.eval_steps_for)."""
    paths = tuple(record_io.list_shards(config.data_dir, tfrecord.VALIDATION))
    if num_pipelines <= 1 or len(paths) < num_pipelines:
        return ValidationSplit(paths, None, config.eval_steps_for(num_pipelines))
    counts = record_counts.lookup(list(paths), record_io.file_sizes(list(paths)), config.data_dir, config.model_dir,
                                  lambda line: print(line, flush=True))
    shares = file_shares(counts, num_pipelines)
    largest = max(sum(counts[i] for i in share) for share in shares)
    per_pipeline_step = max(1, config.eval_batch_size // num_pipelines)
    return ValidationSplit(paths, tuple(tuple(share) for share in shares),
                           max(1, -(-largest // per_pipeline_step)))


def eval_steps(config: Config, num_pipelines: int) -> int:
    """Evaluation steps that cover every validation image once with ``num_pipelines`` input pipelines."""
    if config.synthetic_data or not config.data_dir:
        return config.eval_steps_for(num_pipelines)
    return validation_split(config, num_pipelines).steps


@record_io.traced_as_written
def eval_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                 dtype: Optional[tf.DType] = None, skip_counts: Optional[SkipCounts] = None) -> tf.data.Dataset:
    """Exactly eval_steps(config, P) full batches of (images, labels, weights) per replica, in file order.

    Every validation image appears once with weight 1; the batches are then filled with zero images of
    weight 0, so every replica gets a full batch at every step (TPUs need static shapes, and no replica
    waits on an empty one) and top-1 = sum(weight * correct) / sum(weight) is over the real images only.
    With several input pipelines (hosts), each reads only its share of the files (validation_split: about
    1/hosts of the bytes on a pod, where every host reading the whole set would read it hosts times), and
    eval_steps(config, P) steps cover the largest share; with fewer files than hosts, pipeline p takes records
    p, p + P, ... of every file.
    """
    dtype = dtype or input_pipeline.image_dtype(config)
    num_pipelines = context.num_input_pipelines if context else 1
    split = validation_split(config, num_pipelines)
    paths = list(split.paths)
    if split.shares is not None:
        paths = [paths[index] for index in split.shares[context.input_pipeline_id]]
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
    if num_pipelines > 1 and split.shares is None:
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
    batches = batches.take(split.steps * replicas_per_pipeline)
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
