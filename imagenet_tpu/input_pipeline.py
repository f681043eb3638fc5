"""tf.data pipelines from TFRecord shards to per-replica batches of (images, labels).

Each function that builds a dataset takes a tf.distribute.InputContext, so that
``strategy.distribute_datasets_from_function`` builds one pipeline per host, each reading its own subset of the
files and batching at the per-replica batch size. Without a strategy, pass no context.
"""

import dataclasses
import os
import re
from typing import Optional, Tuple

import tensorflow as tf

from imagenet_tpu import preprocessing, tfrecord
from imagenet_tpu.config import Config, ConfigError

AUTOTUNE = tf.data.AUTOTUNE
RECORD_OVERHEAD_BYTES = 16        # a TFRecord frames each record with length (8), its CRC (4) and a data CRC (4)

# Kinds of element in the file-reading stream (see _read_file).
_RECORD, _FILE_END, _FILE_TRUNCATED = 0, 1, 2


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


def file_sizes(paths: list) -> list:
    """Byte size of each file, checking that each can be opened: a missing or unreadable file is a ConfigError
    at start, not a failure hours into a run."""
    sizes = []
    for path in paths:
        try:
            with tf.io.gfile.GFile(path, 'rb') as f:
                f.read(1)
            sizes.append(tf.io.gfile.stat(path).length)
        except (tf.errors.OpError, OSError) as error:
            raise ConfigError(f'cannot read {path} ({type(error).__name__})') from None
    return sizes


# What a runtime error from the input says, in the words of TensorFlow's kernels (first match wins).
_ERROR_PATTERNS = (
    r'assertion failed: \[([^\]]*)\]',                  # tfrecord.to_model_label: label out of range
    r'((?:truncated|corrupted) record at \d+)',         # a TFRecord file cut or damaged
    r'(Feature: \S+ \(data type: \w+\) is required but could not be found)',   # missing feature
    r'((?:Invalid JPEG data|Unknown image file format|jpeg)[^\n\[]*)',           # a JPEG that does not decode
)


def summarize_graph_error(message: str) -> str:
    """The line of a TensorFlow runtime error that says what went wrong (not the stack of graph nodes)."""
    for pattern in _ERROR_PATTERNS:
        found = re.search(pattern, message)
        if found:
            return found.group(1).strip()
    lines = [line.strip() for line in message.splitlines()
             if line.strip() and not line.startswith((' ', '\t')) and 'Graph execution error' not in line
             and 'derived errors ignored' not in line and not line.startswith('Detected at node')]
    return lines[-1] if lines else message.strip()


def check_labels(path: str, config: Config, records: int = 64) -> None:
    """Reads the first ``records`` labels of a shard and fails at start if any is outside the model's range
    (a wrong --num_classes or --label_offset, rather than a bad record). Records that cannot be read are left
    to the pipeline, which skips and counts them, or with bad_records='fatal' are an error here already."""
    low, high = config.label_offset, config.label_offset + config.num_classes
    iterator = iter(tf.data.TFRecordDataset(path).take(records))
    for index in range(records):
        try:
            label = int(tfrecord.parse_example(next(iterator))['label'])
        except StopIteration:
            return
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
            if config.bad_records == 'fatal':
                raise ConfigError(f'bad input record: {path}: record {index} cannot be read '
                                  f'({summarize_graph_error(error.message)})') from None
            if isinstance(error, tf.errors.DataLossError):
                return
            continue
        except tf.errors.OpError as error:     # a file that cannot be opened (a dangling link, permissions)
            raise ConfigError(f'cannot read {path} ({type(error).__name__})') from None
        if not low <= label < high:
            raise ConfigError(
                f'{path}: on-disk label {label} is outside [{low}, {high}) given --num_classes={config.num_classes}'
                f' and --label_offset={config.label_offset} (ImageNet shards store 1..1000: num_classes=1000,'
                ' label_offset=1)')


def dataset_options(deterministic: bool, threads: int = 0) -> tf.data.Options:
    """The tf.data options every pipeline of ours uses (one place).

    ``threads``: size of the pipeline's private thread pool (0: TensorFlow's shared pool). One thread per
    op inside each map call (max_intra_op_parallelism=1): the parallelism is across images, not within one.
    """
    options = tf.data.Options()
    options.deterministic = deterministic
    options.autotune.enabled = True
    options.experimental_optimization.map_parallelization = True
    options.experimental_optimization.map_fusion = True
    options.experimental_optimization.parallel_batch = True
    options.threading.max_intra_op_parallelism = 1
    if threads:
        options.threading.private_threadpool_size = threads
    return options


class SkipCounts:
    """Bad records skipped and truncated files cut short by the input pipelines of this process.

    With Config.bad_records='skip', a record whose JPEG does not decode, that lacks a feature or whose label is
    out of range is skipped and counted, and a TFRecord file that ends mid-record is read up to its last whole
    record and counted, instead of stopping a long run. The counts are of what the pipelines have read, which
    runs ahead of training by the prefetch buffers.
    """

    def __init__(self):
        self._counters = []

    def new_counters(self) -> Tuple[tf.Variable, tf.Variable]:
        """(bad_records, truncated_files) variables for one more pipeline, on the current (host) device."""
        with tf.init_scope():
            counters = (tf.Variable(0, dtype=tf.int64, trainable=False, name='bad_records'),
                        tf.Variable(0, dtype=tf.int64, trainable=False, name='truncated_files'))
        self._counters.append(counters)
        return counters

    @staticmethod
    def position_counter() -> tf.Variable:
        with tf.init_scope():
            return tf.Variable(0, dtype=tf.int64, trainable=False, name='records_read')

    def totals(self) -> dict:
        return {'bad_records': sum(int(bad.numpy()) for bad, _ in self._counters),
                'truncated_files': sum(int(truncated.numpy()) for _, truncated in self._counters)}


def _per_replica_batch(global_batch: int, context: Optional[tf.distribute.InputContext]) -> int:
    return context.get_per_replica_batch_size(global_batch) if context else global_batch


def _shard_files(paths: list, context: Optional[tf.distribute.InputContext]) -> list:
    """The files of this input pipeline: every num_input_pipelines-th, starting at its id."""
    if context and context.num_input_pipelines > 1:
        return paths[context.input_pipeline_id::context.num_input_pipelines]
    return list(paths)


def _read_file(path: tf.Tensor, size: tf.Tensor, buffer_bytes: int) -> tf.data.Dataset:
    """(record, kind) of one file: every whole record (kind _RECORD), then one end marker that says whether the
    file was complete (_FILE_END) or ended mid-record (_FILE_TRUNCATED: the records before the cut are kept).

    TFRecordDataset raises DataLossError once at a cut and then ends; ignore_errors drops that error, and the
    bytes of the records read, compared with the file's size, tell a cut from a normal end.
    """
    records = tf.data.TFRecordDataset(path, buffer_size=buffer_bytes).ignore_errors()
    records = records.map(lambda record: (record, tf.constant(_RECORD)))
    end = tf.data.Dataset.from_tensors((tf.constant(b''), tf.constant(_FILE_END)))

    def account(read_bytes, element):
        record, kind = element
        read_bytes += tf.cast(tf.strings.length(record), tf.int64) + RECORD_OVERHEAD_BYTES
        kind = tf.where(tf.logical_and(kind == _FILE_END, read_bytes - RECORD_OVERHEAD_BYTES != size),
                        _FILE_TRUNCATED, kind)
        return read_bytes, (record, kind)

    return records.concatenate(end).scan(tf.constant(0, tf.int64), account)


def read_records(paths: list, sizes: list, config: Config, order_seed: Optional[tf.Tensor] = None,
                 truncated: Optional[tf.Variable] = None, deterministic: Optional[bool] = None) -> tf.data.Dataset:
    """Serialized records of ``paths`` read by a parallel interleave, files in an order shuffled by
    ``order_seed`` (none: in the given order). With bad_records='skip', a truncated file ends early and adds
    one to ``truncated``; with 'fatal' its DataLossError stops the run."""
    buffer_bytes = int(config.read_buffer_mb * 2 ** 20)
    cycle_length = min(config.interleave_cycle_length, len(paths))
    deterministic = config.deterministic_input if deterministic is None else deterministic
    order = tf.range(len(paths))
    if order_seed is not None:
        order = tf.random.experimental.stateless_shuffle(order, order_seed)
    files = tf.data.Dataset.from_tensor_slices((tf.gather(paths, order), tf.gather(tf.constant(sizes, tf.int64),
                                                                                   order)))
    if config.bad_records == 'fatal':
        return files.interleave(lambda path, _: tf.data.TFRecordDataset(path, buffer_size=buffer_bytes),
                                cycle_length=cycle_length, block_length=config.interleave_block_length,
                                num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    stream = files.interleave(lambda path, size: _read_file(path, size, buffer_bytes), cycle_length=cycle_length,
                              block_length=config.interleave_block_length, num_parallel_calls=AUTOTUNE,
                              deterministic=deterministic)

    def keep_records(record, kind):
        with tf.control_dependencies([truncated.assign_add(tf.cast(kind == _FILE_TRUNCATED, tf.int64))]):
            return kind == _RECORD

    return stream.filter(keep_records).map(lambda record, kind: record)


def count_records(paths: list, sizes: list, config: Config) -> int:
    """Records in ``paths`` (whole records only, as the training pipeline reads them)."""
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    records = read_records(paths, sizes, config, truncated=counter, deterministic=False)
    return int(records.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))


def _enumerate(records: tf.data.Dataset, read: Optional[tf.Variable]) -> tf.data.Dataset:
    """(index, record) pairs; ``read`` (if given) holds the number of records enumerated so far."""
    indexed = records.enumerate()
    if read is None:
        return indexed

    def note(index, record):
        with tf.control_dependencies([read.assign(index + 1)]):
            return tf.identity(index), record

    return indexed.map(note)


def _decode_guarded(decoded: tf.data.Dataset, bad: Optional[tf.Variable],
                    read: Optional[tf.Variable] = None) -> tf.data.Dataset:
    """Drops elements whose decoding failed, adding their number to ``bad`` (None: errors stop the run).

    ``decoded``'s elements are (index, ...) with consecutive indices in order (a deterministic map): after
    ignore_errors, a gap in the indices is the number of records dropped there. For a finite stream, ``read``
    (the variable _enumerate kept) lets a final marker count the bad records at its very end too.
    """
    if bad is None:
        return decoded.map(lambda index, *rest: rest)
    guarded = decoded.ignore_errors().map(lambda *element: (tf.constant(True), *element))
    if read is not None:
        dummies = tuple(tf.zeros([size or 0 for size in spec.shape], spec.dtype)
                        for spec in decoded.element_spec[1:])
        end = tf.data.Dataset.range(1).map(lambda _: (tf.constant(False), read.read_value(), *dummies))
        guarded = guarded.concatenate(end)

    def count_gap(expected, element):
        real, index, rest = element[0], element[1], element[2:]
        with tf.control_dependencies([bad.assign_add(index - expected)]):
            return index + 1, (tf.identity(real), *rest)

    def is_real(real, *unused_rest):
        return real

    def strip_flag(unused_real, *rest):
        return rest

    return guarded.scan(tf.constant(0, tf.int64), count_gap).filter(is_real).map(strip_flag)


def resume_position(config: Config, start_step: int, context: Optional[tf.distribute.InputContext],
                    records_per_epoch: int) -> Tuple[int, int]:
    """(data epoch, records of it to skip) of this pipeline after ``start_step`` steps: each step takes
    global_batch_size / num_input_pipelines records from every pipeline."""
    pipelines = context.num_input_pipelines if context else 1
    consumed = start_step * (config.global_batch_size // pipelines)
    return divmod(consumed, max(1, records_per_epoch))


def train_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                  dtype: Optional[tf.DType] = None, start_step: int = 0,
                  skip_counts: Optional[SkipCounts] = None) -> tf.data.Dataset:
    """Endless training batches: images [per_replica_batch, size, size, 3] ``dtype`` (default
    image_dtype(config)), labels int32.

    The stream is a sequence of data epochs. Epoch e of pipeline p reads p's files in an order shuffled with
    seed (seed, p, e), shuffles records with the same seed, and crops and flips record i with seed
    (seed, p, e, i), so with deterministic_input each pipeline's stream is a function of the seed and its
    pipeline id, and no two hosts draw the same crops and flips (on a pod, a host's draws repeated on every host
    would put one pattern into every global batch once per host). ``start_step`` > 0 resumes it:
    the records the first start_step steps consumed are skipped before decoding (whole earlier epochs are not
    read at all, the current one is read but not decoded). With bad_records='skip', undecodable records are
    skipped and counted into ``skip_counts``; a resumed stream does not know the bad records of the skipped
    part, so it starts that many records early (those images are seen again).
    """
    dtype = dtype or image_dtype(config)
    paths = _shard_files(list_shards(config.data_dir, tfrecord.TRAIN), context)
    sizes = file_sizes(paths)
    bad, truncated = (skip_counts or SkipCounts()).new_counters()
    pipeline_id = context.input_pipeline_id if context else 0
    base_seed = tf.constant([config.seed or 0, pipeline_id], tf.int64)
    first_epoch, skip = 0, 0
    if start_step:
        first_epoch, skip = resume_position(config, start_step, context, count_records(paths, sizes, config))
    cached = None
    if config.input_cache == 'records':
        cached = read_records(paths, sizes, config, truncated=truncated, deterministic=True).cache()
    elif config.input_cache == 'images':
        read = SkipCounts.position_counter()
        records = read_records(paths, sizes, config, truncated=truncated, deterministic=True)
        decoded = _enumerate(records, read).map(lambda index, record: (index, *_decode_full(record)),
                                                num_parallel_calls=AUTOTUNE, deterministic=True)
        cached = _decode_guarded(decoded, bad if config.bad_records == 'skip' else None, read).cache()

    def epoch_records(epoch):
        seed = tf.random.experimental.stateless_fold_in(base_seed, epoch)
        if cached is not None:
            records = cached
        else:
            records = read_records(paths, sizes, config, order_seed=seed, truncated=truncated)
        records = records.shuffle(config.shuffle_buffer, seed=seed[0] + 7919 * seed[1])
        records = records.enumerate().map(lambda index, record: (epoch, index, record))
        return records.skip(tf.where(epoch == first_epoch, tf.constant(skip, tf.int64), 0))

    stream = tf.data.Dataset.range(first_epoch, 2 ** 62).flat_map(epoch_records)

    def parse(position, epoch, index, record):
        seed = tf.random.experimental.stateless_fold_in(tf.random.experimental.stateless_fold_in(
            base_seed, epoch), index)
        if config.input_cache == 'images':
            image, label = record
            image = preprocessing.preprocess_decoded_for_train(
                image, config.image_size, min_area=config.random_crop_min_area, flip=config.random_flip,
                dtype=dtype, seed=seed)
        else:
            example = tfrecord.parse_example(record)
            image = preprocessing.preprocess_for_train(
                example['encoded'], example['boxes'] if config.crop_boxes else tf.zeros([0, 4]), config.image_size,
                min_area=config.random_crop_min_area,
                flip=config.random_flip, dtype=dtype, seed=seed)
            label = example['label']
        return position, image, tfrecord.to_model_label(label, config.label_offset, config.num_classes)

    stream = stream.enumerate().map(lambda position, element: (position, *element))
    decoded = stream.map(parse, num_parallel_calls=AUTOTUNE, deterministic=True)
    examples = _decode_guarded(decoded, bad if config.bad_records == 'skip' else None)
    batches = examples.batch(_per_replica_batch(config.global_batch_size, context), drop_remainder=True)
    return _finish(batches, config).with_options(
        dataset_options(config.deterministic_input, config.input_threads))


def _decode_full(record: tf.Tensor):
    """(uint8 image, on-disk label) of a record, for the decoded-image cache."""
    example = tfrecord.parse_example(record)
    return tf.io.decode_jpeg(example['encoded'], channels=3, dct_method=preprocessing.DCT_METHOD), example['label']


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
    dtype = dtype or image_dtype(config)
    paths = list_shards(config.data_dir, tfrecord.VALIDATION)
    bad, truncated = (skip_counts or SkipCounts()).new_counters()
    records = read_records(paths, file_sizes(paths), dataclasses.replace(config, interleave_cycle_length=1),
                           truncated=truncated, deterministic=True)
    num_pipelines = context.num_input_pipelines if context else 1
    if num_pipelines > 1:
        records = records.shard(num_pipelines, context.input_pipeline_id)

    def parse(index, serialized):
        example = tfrecord.parse_example(serialized)
        image = preprocessing.preprocess_for_eval(example['encoded'], config.image_size, dtype=dtype,
                                                  crop_fraction=config.eval_crop)
        label = tfrecord.to_model_label(example['label'], config.label_offset, config.num_classes)
        return index, image, label, tf.constant(1.0)

    read = SkipCounts.position_counter()
    examples = _decode_guarded(_enumerate(records, read).map(parse, num_parallel_calls=AUTOTUNE, deterministic=True),
                               bad if config.bad_records == 'skip' else None, read)
    padding = tf.data.Dataset.from_tensors(
        (tf.zeros([config.image_size, config.image_size, 3], dtype), tf.constant(0), tf.constant(0.0))).repeat()
    replicas_per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines if context else 1
    batches = examples.concatenate(padding)
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
