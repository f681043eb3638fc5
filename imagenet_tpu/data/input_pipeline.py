"""tf.data streams from TFRecord shards to per-replica batches of (images, labels): training, evaluation and
synthetic. Reading the files and accounting for bad records is record_io.py's.

Each function that builds a dataset takes a tf.distribute.InputContext, so that
``strategy.distribute_datasets_from_function`` builds one pipeline per host, each reading its own subset of the
files and batching at the per-replica batch size. Without a strategy, pass no context.
"""

from typing import Callable, Optional, Sequence, Tuple

import tensorflow as tf

from imagenet_tpu.config import Config
from imagenet_tpu.data import preprocessing, record_counts, record_io, tfrecord
from imagenet_tpu.data.record_io import SkipCounts
from imagenet_tpu.errors import DataError

AUTOTUNE = tf.data.AUTOTUNE


def reader_settings(config: Config) -> dict:
    """record_io.read_records' and file_records' settings from a Config: buffer_bytes and fatal_errors."""
    return {'buffer_bytes': int(config.read_buffer_mb * 2 ** 20), 'fatal_errors': config.bad_records == 'fatal'}


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


def per_replica_batch(global_batch: int, context: Optional[tf.distribute.InputContext]) -> int:
    return context.get_per_replica_batch_size(global_batch) if context else global_batch


def pipeline_files(paths: list, context: Optional[tf.distribute.InputContext]) -> list:
    """The files of this input pipeline: every num_input_pipelines-th, starting at its id."""
    if context and context.num_input_pipelines > 1:
        return paths[context.input_pipeline_id::context.num_input_pipelines]
    return list(paths)


def resume_position(config: Config, start_step: int, context: Optional[tf.distribute.InputContext],
                    records_per_epoch: int) -> Tuple[int, int]:
    """(data epoch, records of it to skip) of this pipeline after ``start_step`` steps: each step takes
    global_batch_size / num_input_pipelines records from every pipeline."""
    pipelines = context.num_input_pipelines if context else 1
    consumed = start_step * (config.global_batch_size // pipelines)
    return divmod(consumed, max(1, records_per_epoch))


def file_position(file_records: Sequence[int], position: int) -> Tuple[int, int]:
    """(file, records of it to skip) of record ``position`` of files read one after another, which hold
    ``file_records`` records."""
    for number, records in enumerate(file_records):
        if position < records:
            return number, position
        position -= records
    raise ValueError(f'record {position} is past the end of the files')


def file_order(base_seed: tf.Tensor, epoch, num_files: int) -> tf.Tensor:
    """The order in which a pipeline reads its files in ``epoch``: a permutation seeded by (seed, pipeline,
    epoch)."""
    return tf.random.experimental.stateless_shuffle(tf.range(num_files), fold_seed(base_seed, epoch))


EPOCH_KEYS = 2 ** 40   # a record's key: epoch * EPOCH_KEYS + its index in the epoch


def fold_seed(seed: tf.Tensor, *values) -> tf.Tensor:
    for value in values:
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(value, tf.int64))
    return seed


@record_io.traced_as_written
def train_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                  dtype: Optional[tf.DType] = None, start_step: int = 0,
                  skip_counts: Optional[SkipCounts] = None, log: Callable[[str], None] = print,
                  served: bool = False, shards: Optional[Tuple[list, list]] = None) -> tf.data.Dataset:
    """Endless training batches: images [per_replica_batch, size, size, 3] ``dtype`` (default
    image_dtype(config)), labels int32. ``served``: the dataset a tf.data service's workers run
    (service.py): bad records are skipped without counting (the count would stay on the workers) and the
    batches are not prefetched (the trainer does that).

    The stream is a sequence of data epochs. In epoch e, pipeline p reads its files one after another, in an
    order shuffled with seed (seed, p, e), while the next interleave_cycle_length files are read ahead in
    parallel. Window w of that record stream (shuffle_window records) is shuffled in full with seed
    (seed, p, e, w), and the i-th record of the epoch is cropped and flipped with seed (seed, p, key) with key
    e * EPOCH_KEYS + i. With
    deterministic each pipeline's stream is therefore a function of the seed and its pipeline id, and no two
    hosts draw the same crops and flips (on a pod, a host's draws repeated on every host would put one pattern
    into every global batch once per host).

    ``start_step`` > 0 resumes it. The files' record counts (record_counts.py) say in which file the window of
    its place starts, and where: earlier files are not opened, that file is read from its start but its records
    before the window are dropped, and the records of the window before the place are not decoded. With
    bad_records='skip', undecodable records are skipped and counted into ``skip_counts``; a resumed stream does
    not know the bad records of the skipped part, so it starts that many records early (those images are seen
    again).

    ``shards``: (every training shard's path, its size) as listed once for all the input pipelines a process
    builds (builders.build_train_dataset): a TPU client builds one per host, and each would list and stat every
    shard again, one host after another.
    """
    dtype = dtype or image_dtype(config)
    if shards is None:
        paths = pipeline_files(record_io.list_shards(config.data_dir, tfrecord.TRAIN), context)
        sizes = record_io.file_sizes(paths)
    else:
        paths, sizes = pipeline_files(shards[0], context), pipeline_files(shards[1], context)
    bad, truncated = (None, None) if served else (skip_counts or SkipCounts()).new_counters()
    base_seed = pipeline_seed(config, context)
    first_epoch, skip, first_file, file_skip = 0, 0, 0, 0
    if start_step:
        counts = record_counts.lookup(paths, sizes, config.data_dir, config.model_dir, log)
        if not sum(counts):
            raise DataError(f'the training files hold no whole record ({record_io.describe_files(paths)})')
        first_epoch, skip = resume_position(config, start_step, context, sum(counts))
        if config.input_cache == 'none':
            with tf.init_scope():
                order = file_order(base_seed, first_epoch, len(paths)).numpy()
            window = shuffle_window(config, context)
            first_file, file_skip = file_position([counts[i] for i in order], skip - skip % window)
            _check_count(paths[order[first_file]], counts[order[first_file]])

    if config.input_cache == 'none':
        stream = _windowed_stream(config, shuffle_window(config, context), paths, sizes, base_seed, first_epoch,
                                  skip, first_file, file_skip, truncated)
    else:
        stream = _cached_stream(config, paths, sizes, base_seed, first_epoch, skip, bad, truncated)

    parse_record = record_parser(config, dtype, base_seed)
    blank = (tf.zeros([config.image_size, config.image_size, 3], dtype), tf.constant(0, tf.int32))

    def parse(position, element):
        heartbeat = element[0] < 0      # HEARTBEAT_KEY: nothing to decode
        image, label = tf.cond(heartbeat, lambda: blank, lambda: parse_record(*element))
        return position, heartbeat, image, label

    decoded = stream.enumerate().map(parse, num_parallel_calls=AUTOTUNE, deterministic=True)
    if served:
        examples = skip_bad_records(decoded.filter(lambda index, heartbeat, *rest: tf.logical_not(heartbeat))
                                    .map(lambda index, heartbeat, *rest: (index, *rest)), config)
    else:
        windows = (max(1, -(-pipeline_epoch_records(config, context) // shuffle_window(config, context)))
                   if config.input_cache == 'none' else 1)
        examples = record_io.decode_guarded(decoded, bad if config.bad_records == 'skip' else None,
                                            heartbeat_limit=windows + 1, files=record_io.describe_files(paths))
    batches = examples.batch(per_replica_batch(config.global_batch_size, context), drop_remainder=True)
    batches = space_to_depth(batches, config)
    return (batches if served else batches.prefetch(AUTOTUNE)).with_options(
        dataset_options(config.deterministic, config.input_threads))


def shuffled(records: tf.data.Dataset, buffer: int, seed: tf.Tensor) -> tf.data.Dataset:
    """``records`` shuffled in a buffer of ``buffer``, in an order that comes from ``seed`` ([2] int64) alone, not
    from TensorFlow's global seed: with a global seed of 0 (--seed=0) TensorFlow fails on a tensor op seed
    (random_seed.py get_seed compares (0, seed) with (0, 0) as Python bools), and a user's tf.random.set_seed
    would otherwise change the data order."""
    graph = tf.compat.v1.get_default_graph()
    global_seed, graph.seed = graph.seed, None
    try:
        return records.shuffle(buffer, seed=seed[0] + 7919 * seed[1])
    finally:
        graph.seed = global_seed


def pipeline_seed(config: Config, context: Optional[tf.distribute.InputContext]) -> tf.Tensor:
    """The seed every random choice of this input pipeline derives from: (seed, pipeline id)."""
    return tf.constant([config.seed or 0, context.input_pipeline_id if context else 0], tf.int64)


def record_parser(config: Config, dtype: tf.DType, base_seed: tf.Tensor) -> Callable:
    """parse(key, record) -> (image, label) of a training record: the random crop and flip are seeded by
    (base_seed, key), so they depend on the record's key alone, not on when or where it is decoded."""

    layout = tfrecord.layout_of(config.data_dir)

    def parse(key, record):
        seed = fold_seed(base_seed, key)
        if config.input_cache == 'images':
            image, label = record
            image = preprocessing.preprocess_decoded_for_train(
                image, config.image_size, min_area=config.random_crop_min_area, flip=config.random_flip,
                dtype=dtype, seed=seed, resize_method=config.resize_method)
        else:
            example = layout.parse(record)
            preprocess = preprocessing.preprocess_any_for_train if layout.tfds else preprocessing.preprocess_for_train
            image = preprocess(
                example['encoded'], example['boxes'] if config.crop_boxes else tf.zeros([0, 4]), config.image_size,
                min_area=config.random_crop_min_area, flip=config.random_flip, dtype=dtype, seed=seed,
                resize_method=config.resize_method)
            label = example['label']
        return image, tfrecord.to_model_label(label, config.label_offset, config.num_classes)

    return parse


def skip_bad_records(decoded: tf.data.Dataset, config: Config) -> tf.data.Dataset:
    """(index, ...) elements without the index; with bad_records='skip' those whose decoding failed are dropped
    without being counted (the tf.data service's workers cannot report counts)."""
    if config.bad_records == 'skip':
        decoded = decoded.ignore_errors()
    return decoded.map(lambda index, *rest: rest)


WINDOWS_PER_EPOCH = 8     # at least: a resume reads at most about two windows, a quarter of an epoch
HEARTBEAT_KEY = -1        # the key of the element after each window (or cached epoch): record_io.decode_guarded


def heartbeat_after(records: tf.data.Dataset) -> tf.data.Dataset:
    """(key, record) elements followed by one heartbeat (HEARTBEAT_KEY, an empty record of the same structure)."""
    spec = records.element_spec[1]
    empty = tf.nest.map_structure(lambda s: tf.zeros([d or 1 for d in s.shape], s.dtype), spec)
    return records.concatenate(tf.data.Dataset.from_tensors((tf.constant(HEARTBEAT_KEY, tf.int64), empty)))


def pipeline_epoch_records(config: Config, context: Optional[tf.distribute.InputContext]) -> int:
    """Records in one epoch of this input pipeline, as the settings give it (num_train_images / pipelines)."""
    pipelines = context.num_input_pipelines if context else 1
    return max(1, -(-config.num_train_images // pipelines))


def shuffle_window(config: Config, context: Optional[tf.distribute.InputContext]) -> int:
    """Records shuffled together: shuffle_buffer, but at most 1/WINDOWS_PER_EPOCH of this pipeline's epoch
    (num_train_images / input pipelines), so that a resume never reads most of a small data set. The same
    in a fresh and a resumed run (it depends on settings only), as exact resume needs."""
    pipelines = context.num_input_pipelines if context else 1
    return max(1, min(config.shuffle_buffer, -(-config.num_train_images // (pipelines * WINDOWS_PER_EPOCH))))


def _windowed_stream(config: Config, window: int, paths: list, sizes: list, base_seed: tf.Tensor,
                     first_epoch: int, skip: int, first_file: int, file_skip: int,
                     truncated: tf.Variable) -> tf.data.Dataset:
    """(key, record) of the files read one after another, each window of ``window`` records
    shuffled in full (shuffle_window); from record ``skip`` of ``first_epoch`` on, whose window starts at record
    ``file_skip`` of the epoch's file number ``first_file``. The next window is read and shuffled while this
    one is used (so about three windows of records are in memory)."""
    paths_tensor, sizes_tensor = tf.constant(paths), tf.constant(sizes, tf.int64)
    first_window = skip // window

    def epoch_windows(epoch):
        resumed = epoch == first_epoch
        files = file_order(base_seed, epoch, len(paths))[tf.where(resumed, first_file, 0):]
        skips = tf.concat([[tf.where(resumed, tf.constant(file_skip, tf.int64), 0)],
                           tf.zeros(tf.size(files) - 1, tf.int64)], axis=0)
        records = record_io.read_records(tf.gather(paths_tensor, files), tf.gather(sizes_tensor, files),
                                         truncated=truncated, skips=skips, whole_files=True,
                                         cycle_length=min(config.interleave_cycle_length, len(paths)),
                                         deterministic=config.deterministic, **reader_settings(config))
        windows = records.window(window).enumerate(tf.where(resumed, tf.constant(first_window, tf.int64), 0))
        return windows.map(lambda number, records: (epoch, number, records))

    # Dataset.window holds a window's records without copying them (batch and gather would copy every
    # record's bytes twice); prefetch reads the next window while this one is used. A shuffle buffer as large as
    # the window draws a uniformly random permutation of it.
    windows = tf.data.Dataset.range(first_epoch, 2 ** 62).flat_map(epoch_windows).prefetch(1)

    def window_records(epoch, number, records):
        records = shuffled(records, window, fold_seed(base_seed, epoch, -1 - number))
        start = tf.where(tf.logical_and(epoch == first_epoch, number == first_window),
                         tf.constant(skip % window, tf.int64), 0)
        return heartbeat_after(records.enumerate(epoch * EPOCH_KEYS + number * window).skip(start))

    return windows.flat_map(window_records)


def _check_count(path: str, count: int) -> None:
    """The file a resumed stream starts in is counted again (its length fields only): a counts file whose size
    matches but whose count does not is an error, not a silently wrong place in the data."""
    actual = record_counts.count_file(path)
    if actual != count:
        raise DataError(f'{record_counts.FILE_NAME} gives {path} {count} records but it holds {actual}: '
                        f'delete the wrong {record_counts.FILE_NAME} (beside the shards or in --model_dir)')


def _cached_stream(config: Config, paths: list, sizes: list, base_seed: tf.Tensor, first_epoch: int, skip: int,
                   bad: tf.Variable, truncated: tf.Variable) -> tf.data.Dataset:
    """(key, record) of the in-memory training set: read once in file order, cached, then
    shuffled anew in every epoch with a shuffle buffer."""
    records = record_io.read_records(paths, sizes, truncated=truncated, deterministic=True,
                                     cycle_length=min(config.interleave_cycle_length, len(paths)),
                                     **reader_settings(config))
    if config.input_cache == 'records':
        cached = records.cache()
    else:
        read, layout = SkipCounts.position_counter(), tfrecord.layout_of(config.data_dir)
        decoded = record_io.enumerate_records(records, read).map(
            lambda index, record: (index, *_decode_full(record, layout)), num_parallel_calls=AUTOTUNE,
            deterministic=True)
        cached = record_io.decode_guarded(decoded, bad if config.bad_records == 'skip' else None, read).cache()

    def epoch_records(epoch):
        seed = fold_seed(base_seed, epoch, -1)
        records = shuffled(cached, config.shuffle_buffer, seed).enumerate()
        records = records.skip(tf.where(epoch == first_epoch, tf.constant(skip, tf.int64), 0))
        return heartbeat_after(records.map(lambda index, record: (epoch * EPOCH_KEYS + index, record)))

    return tf.data.Dataset.range(first_epoch, 2 ** 62).flat_map(epoch_records)


def _decode_full(record: tf.Tensor, layout: tfrecord.Layout):
    """(uint8 image, on-disk label) of a record, for the decoded-image cache."""
    example = layout.parse(record)
    decode = preprocessing.decode_any if layout.tfds else preprocessing.decode_jpeg
    return decode(example['encoded']), example['label']


def image_dtype(config: Config) -> tf.DType:
    """The dtype images leave the pipeline in: bfloat16 when the model computes in bfloat16."""
    return tf.bfloat16 if config.precision == 'mixed_bfloat16' else tf.float32


def space_to_depth(batches: tf.data.Dataset, config: Config) -> tf.data.Dataset:
    """Space-to-depth on whole batches when the model's stem expects it (cheaper than per image)."""
    if config.space_to_depth:
        batches = batches.map(lambda images, *rest: (tf.nn.space_to_depth(images, 2), *rest),
                              num_parallel_calls=AUTOTUNE)
    return batches


@record_io.traced_as_written
def synthetic_dataset(config: Config, context: Optional[tf.distribute.InputContext] = None,
                      dtype: Optional[tf.DType] = None) -> tf.data.Dataset:
    """One fixed random batch repeated forever: measures the model without any input cost."""
    dtype = dtype or image_dtype(config)
    batch = per_replica_batch(config.global_batch_size, context)
    images = tf.random.stateless_normal([batch, config.image_size, config.image_size, 3], seed=[0, 1], dtype=dtype)
    if config.space_to_depth:
        images = tf.nn.space_to_depth(images, 2)
    labels = tf.random.stateless_uniform([batch], seed=[0, 2], maxval=config.num_classes, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat().with_options(dataset_options(False))
