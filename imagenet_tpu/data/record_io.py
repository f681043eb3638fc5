"""Record I/O under the input streams: listing and checking shards, reading TFRecord files with a parallel
interleave, and the accounting of bad records and truncated files (SkipCounts) that lets a long run skip them."""

import concurrent.futures
import functools
import os
import stat
from typing import Optional, Tuple

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx  # pylint: disable=no-name-in-module
from tensorflow.python.util import deprecation  # pylint: disable=no-name-in-module

from imagenet_tpu.files import is_local, matching
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import tfrecord
from imagenet_tpu.errors import ConfigError, DataError, summarize_graph_error

AUTOTUNE = tf.data.AUTOTUNE


def traced_as_written(build):
    """Builds a tf.data stream without AutoGraph: ``build``'s map, filter, scan and interleave functions are traced
    as written.

    tf.data traces each such function when the dataset is built, and by default first rewrites its source with
    AutoGraph (Python control flow on tensors into tf.cond and tf.while_loop): for this package's streams, training
    and evaluation, that rewriting was 4 of the 5.7 s their construction took in a fresh process. None of the
    functions needs it: their control flow on tensors is tf.cond, tf.where and tf.data's own operations, and a
    Python ``if`` or ``for`` on a tensor would fail loudly when traced, not silently. tf.data's functions follow
    AutoGraph's control status (tensorflow/python/data/ops/structured_function.py, StructuredFunctionWrapper: the
    function goes through autograph.tf_convert with ag_ctx.control_status_ctx()); this sets it to disabled for
    the call."""

    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.DISABLED):
            return build(*args, **kwargs)
    return wrapper


# Kinds of element in the file-reading stream (see _read_file).
_RECORD, _FILE_END, _FILE_TRUNCATED = 0, 1, 2


def list_shards(data_dir: Optional[str], split: str) -> list:
    """Sorted shard paths of ``split`` in ``data_dir``; ConfigError without a data_dir, DataError when it
    holds none."""
    if not data_dir:
        raise ConfigError('--data_dir is not set (or pass --synthetic_data for a run without input)')
    if not tf.io.gfile.isdir(data_dir):
        raise DataError(f'--data_dir {data_dir} does not exist or is not a directory')
    pattern = tfrecord.file_pattern(data_dir, split)
    paths = matching(pattern)
    if not paths:
        raise DataError(f'no {split} files matching {os.path.basename(pattern)} in --data_dir {data_dir}')
    return paths


def file_sizes(paths: list) -> list:
    """Byte size of each file, checking that each can be opened: a missing or unreadable file is a DataError
    at start, not a failure hours into a run. Nothing is read (a resumed run reads only where it resumes).
    Remote files (gs://...) are asked for many at once: each answer waits mostly on the network, and a pod's
    1,024 shards one after another would take most of a minute."""
    if len(paths) > 1 and not all(is_local(path) for path in paths):
        with concurrent.futures.ThreadPoolExecutor(record_counts.REMOTE_WORKERS) as pool:
            return list(pool.map(_file_size, paths))
    return [_file_size(path) for path in paths]


def _file_size(path: str) -> int:
    try:
        size = tf.io.gfile.stat(path).length
        if is_local(path):
            if not stat.S_ISREG(os.stat(path).st_mode):     # a FIFO or device: opening or reading it can hang
                raise DataError(f'{path} is not a regular file (a FIFO, a device or a folder): move it out of the '
                                'data folder')
            os.close(os.open(path, os.O_RDONLY))   # permissions, without reading (stat does not check them)
    except (tf.errors.OpError, OSError) as error:
        raise DataError(f'cannot read {path} ({type(error).__name__})') from None
    return size


def check_labels(path: str, num_classes: int, label_offset: int, fatal_errors: bool, records: int = 64) -> None:
    """Reads the first ``records`` labels of a shard and fails at start if any is outside the model's range
    [label_offset, label_offset + num_classes) (a wrong --num_classes or --label_offset, rather than a bad
    record). Records that cannot be read are left to the pipeline, which skips and counts them, or with
    ``fatal_errors`` (bad_records='fatal') are an error here already. The shard's layout is its folder's."""
    low, high = label_offset, label_offset + num_classes
    layout = tfrecord.layout_of(os.path.dirname(path))
    try:    # all at once (one read, one traced parse): a shard whose records all read and parse, the usual case
        labels = layout.label_parser(batched=True)(
            tf.data.TFRecordDataset(path).take(records).batch(records).get_single_element()).numpy()
    except (tf.errors.OpError, ValueError):   # a bad record, a truncated file, no file, no records: one at a time
        labels = None
    if labels is not None:
        for label in labels:
            _check_label(int(label), low, high, path, layout, num_classes, label_offset)
        return
    iterator, parse = iter(tf.data.TFRecordDataset(path).take(records)), layout.label_parser()
    for index in range(records):
        try:
            label = int(parse(next(iterator)))
        except StopIteration:
            return
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
            if fatal_errors:
                raise DataError(f'bad input record: {path}: record {index} cannot be read '
                                  f'({summarize_graph_error(error.message)})') from None
            if isinstance(error, tf.errors.DataLossError):
                return
            continue
        except tf.errors.OpError as error:     # a file that cannot be opened (a dangling link, permissions)
            raise DataError(f'cannot read {path} ({type(error).__name__})') from None
        _check_label(label, low, high, path, layout, num_classes, label_offset)


def _check_label(label: int, low: int, high: int, path: str, layout, num_classes: int, label_offset: int) -> None:
    if not low <= label < high:
        read_as = f' (tensorflow_datasets label {label - 1}, read as {label})' if layout.tfds else ''
        raise DataError(
            f'{path}: on-disk label {label}{read_as} is outside [{low}, {high}) given --num_classes={num_classes}'
            f' and --label_offset={label_offset} (ImageNet shards store 1..1000, and tensorflow_datasets\'s'
            ' 0..999 are read as 1..1000: num_classes=1000, label_offset=1)')


class SkipCounts:
    """Bad records skipped and truncated files cut short by the input pipelines of this process.

    With bad_records='skip', a record whose JPEG does not decode, that lacks a feature or whose label is
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
        read_bytes += tf.cast(tf.strings.length(record), tf.int64) + record_counts.FRAME_BYTES
        kind = tf.where(tf.logical_and(kind == _FILE_END, read_bytes - record_counts.FRAME_BYTES != size),
                        _FILE_TRUNCATED, kind)
        return read_bytes, (record, kind)

    return records.concatenate(end).scan(tf.constant(0, tf.int64), account)


READ_AHEAD_RECORDS = 64   # records each file being read ahead may buffer (whole_files=True): ~7 MB of ImageNet


def file_records(path: tf.Tensor, size: tf.Tensor, skip, buffer_bytes: int, fatal_errors: bool,
                 truncated: Optional[tf.Variable] = None) -> tf.data.Dataset:
    """The whole records of one file from its ``skip``-th on (the ones before are read, not returned), read
    through a buffer of ``buffer_bytes``. With ``fatal_errors`` a file cut mid-record stops the run with
    TensorFlow's DataLossError; else it ends at its last whole record and adds one to ``truncated``."""
    if fatal_errors:
        return tf.data.TFRecordDataset(path, buffer_size=buffer_bytes).skip(skip)

    def keep_records(record, kind):
        if truncated is None:
            return kind == _RECORD
        with tf.control_dependencies([truncated.assign_add(tf.cast(kind == _FILE_TRUNCATED, tf.int64))]):
            return kind == _RECORD

    records = _read_file(path, size, buffer_bytes).filter(keep_records)
    return records.map(lambda record, kind: record).skip(skip)


def read_records(paths, sizes, *, buffer_bytes: int, fatal_errors: bool, deterministic: bool, cycle_length: int,
                 truncated: Optional[tf.Variable] = None, skips=None, whole_files: bool = False) -> tf.data.Dataset:
    """Serialized records of ``paths`` (a list or a string tensor; ``sizes`` their byte sizes), ``cycle_length``
    files read at once by a parallel interleave, each through a buffer of ``buffer_bytes``.

    Records alternate between the open files, or with ``whole_files`` come file after file, in order, while
    the next files are read ahead in parallel (READ_AHEAD_RECORDS each). ``skips`` (one per file) leaves out
    that many records at the start of each file. With bad_records='skip', a truncated file ends early and adds
    one to ``truncated``; with ``fatal_errors`` its DataLossError stops the run."""
    sizes = tf.cast(sizes, tf.int64)
    skips = tf.zeros_like(sizes) if skips is None else tf.cast(skips, tf.int64)
    files = tf.data.Dataset.from_tensor_slices((paths, sizes, skips))

    def read(path, size, skip):
        return file_records(path, size, skip, buffer_bytes, fatal_errors, truncated)

    if not whole_files:
        return files.interleave(read, cycle_length=cycle_length, num_parallel_calls=AUTOTUNE,
                                deterministic=deterministic)
    return interleave_without_prefetch(files, read, cycle_length, block_length=2 ** 62, sloppy=not deterministic)


def interleave_without_prefetch(files: tf.data.Dataset, read, cycle_length: int, block_length: int,
                                sloppy: bool) -> tf.data.Dataset:
    """files.interleave(read) over cycle_length files, each read ahead by READ_AHEAD_RECORDS records, and no
    file opened (or, from a tf.data service, claimed) before a reader is free for it. Dataset.interleave gives
    the same order but opens several elements beyond the cycle and buffers far more of each; the older
    tf.data.experimental.parallel_interleave lets both be set."""
    with deprecation.silence():
        return files.apply(tf.data.experimental.parallel_interleave(
            read, cycle_length=cycle_length, block_length=block_length, sloppy=sloppy,
            buffer_output_elements=READ_AHEAD_RECORDS, prefetch_input_elements=0))


def enumerate_records(records: tf.data.Dataset, read: Optional[tf.Variable]) -> tf.data.Dataset:
    """(index, record) pairs; ``read`` (if given) holds the number of records enumerated so far."""
    indexed = records.enumerate()
    if read is None:
        return indexed

    def note(index, record):
        with tf.control_dependencies([read.assign(index + 1)]):
            return tf.identity(index), record

    return indexed.map(note)


NO_USABLE_RECORD = 'no usable record'   # the start of the error a stream of failures ends with (training/loop.py)


def describe_files(paths) -> str:
    """A short name for the files of an input: all of them when few, else how many and the first."""
    paths = [str(path) for path in paths]
    if len(paths) <= 3:
        return ', '.join(paths)
    return f'{len(paths)} files from {paths[0]} to {paths[-1]}'


def decode_guarded(decoded: tf.data.Dataset, bad: Optional[tf.Variable],
                    read: Optional[tf.Variable] = None, heartbeat_limit: Optional[int] = None,
                    files: str = '') -> tf.data.Dataset:
    """Drops elements whose decoding failed, adding their number to ``bad`` (None: errors stop the run).

    ``decoded``'s elements are (index, ...) with consecutive indices in order (a deterministic map): after
    ignore_errors, a gap in the indices is the number of records dropped there. For a finite stream, ``read``
    (the variable enumerate_records kept) lets a final marker count the bad records at its very end too.

    With ``heartbeat_limit``, elements are (index, heartbeat, ...): the endless training streams put a heartbeat
    (an element that cannot fail) after every window or epoch of records. ignore_errors drops failures without
    end, so a stream in which every record fails would never yield anything; the heartbeats pass, and when
    ``heartbeat_limit`` of them pass in a row without a record that decodes (a whole epoch of failures), the
    stream stops with an InvalidArgumentError starting with NO_USABLE_RECORD and naming ``files``.
    """
    if heartbeat_limit is not None:
        is_record = lambda index, heartbeat, *rest: tf.logical_not(heartbeat)   # noqa: E731
        strip_heartbeat = lambda index, heartbeat, *rest: (index, *rest)       # noqa: E731
    if bad is None:
        if heartbeat_limit is not None:
            decoded = decoded.filter(is_record).map(strip_heartbeat)
        return decoded.map(lambda index, *rest: rest)
    if heartbeat_limit is None:
        decoded = decoded.map(lambda index, *rest: (index, tf.constant(False), *rest))
    guarded = decoded.ignore_errors().map(lambda *element: (tf.constant(True), *element))
    if read is not None:
        dummies = tuple(tf.zeros([size or 0 for size in spec.shape], spec.dtype)
                        for spec in decoded.element_spec[1:])
        end = tf.data.Dataset.range(1).map(lambda _: (tf.constant(False), read.read_value(), *dummies))
        guarded = guarded.concatenate(end)
    message = (f'{NO_USABLE_RECORD}: every record of a whole epoch of the training input failed to decode '
               f'or was bad ({files or "its files"}); check the files or --num_classes and --label_offset')
    message = message.replace('[', '(').replace(']', ')')

    def count_gap(state, element):
        expected, empty = state
        real, index, heartbeat, rest = element[0], element[1], element[2], element[3:]
        empty = tf.where(heartbeat, empty + 1, tf.where(real, tf.constant(0, tf.int64), empty))
        checks = [bad.assign_add(index - expected)]
        if heartbeat_limit is not None:
            checks.append(tf.debugging.assert_less(empty, tf.constant(heartbeat_limit, tf.int64), message=message))
        with tf.control_dependencies(checks):
            return (index + 1, empty), (tf.logical_and(real, tf.logical_not(heartbeat)), *rest)

    def is_real(real, *unused_rest):
        return real

    def strip_flag(unused_real, *rest):
        return rest

    zero = tf.constant(0, tf.int64)
    return guarded.scan((zero, zero), count_gap).filter(is_real).map(strip_flag)
