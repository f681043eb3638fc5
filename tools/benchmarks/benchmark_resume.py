"""Start-up of a resumed training stream on a split of many shards: how it finds its place in the data.

    python tools/benchmarks/benchmark_resume.py --data_dir data/resume_benchmark --num_shards 1024 --rounds 3

Writes the split on first use (--num_shards shards of --records_per_shard small JPEG records; nothing else),
then times, alternating for --rounds rounds, three ways of getting the per-shard record counts a resumed stream
needs (input_pipeline.train_dataset with start_step > 0):
  reading  every record of every shard read through TFRecordDataset (a parallel interleave), which is what a
           resume cost before the counts existed;
  walk     record_counts.count_file on every shard: the length fields only, as for shards written by other
           tools (the result is then cached in model_dir);
  file     record_counts.txt beside the shards (what the converter and the data tools write).
and then the time to the first batch of the stream resumed at --resume_step, with the counts file present.
Each figure is a median over rounds, with the bytes the process read for it (/proc/self/io rchar, Linux).

Then counting on a non-local file system: --num_shards shards of --remote_records_per_shard records of
--remote_record_bytes (ImageNet's ~110 KB) in --remote_dir (TensorFlow's in-memory ram://), counted
  remote_seek      as record_counts did before: one file after another, seeking through tf.io.gfile.GFile to
                   each record's length field (old_scan_file below, kept here only as the baseline);
  remote_blocks    record_counts.scan_file one file after another: each read once in order, in large blocks;
  remote_parallel  record_counts.count_files: the same, many files at once (what lookup does);
  remote_seek_parallel  the old way, as many files at once (which of the two changes the gain comes from).
ram:// has no latency: this measures the CPU of the copying and the calls, not the waiting on requests that
makes a remote store slow (and that counting many files at once overlaps). --local=false times this part only.
The last line is one JSON object with every figure.
"""

import concurrent.futures
import json
import os
import shutil
import statistics
import struct
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags  # noqa: E402

from imagenet_tpu import runtime  # noqa: E402  (before TensorFlow: the package's oneDNN setting)

tf = runtime.import_tensorflow()
import numpy as np  # noqa: E402

from imagenet_tpu.data import input_pipeline
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord  # noqa: E402
from imagenet_tpu.config import Config  # noqa: E402

_DATA_DIR = flags.DEFINE_string('data_dir', 'data/resume_benchmark', 'Where the split is (written if missing).')
_NUM_SHARDS = flags.DEFINE_integer('num_shards', 1024, 'Training shards.')
_RECORDS = flags.DEFINE_integer('records_per_shard', 64, 'Records per shard.')
_RESUME_STEP = flags.DEFINE_integer('resume_step', 1000, 'The step the stream resumes at (batch 64).')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Alternating rounds; figures are medians.')
_LOCAL = flags.DEFINE_bool('local', True, 'Time the local split too (else the non-local counting only).')
_REMOTE_DIR = flags.DEFINE_string('remote_dir', 'ram://resume_benchmark', 'The non-local split (written anew).')
_REMOTE_RECORDS = flags.DEFINE_integer('remote_records_per_shard', 8, 'Records per non-local shard.')
_REMOTE_RECORD_BYTES = flags.DEFINE_integer('remote_record_bytes', 110_000, 'Bytes of each non-local record.')


def bytes_read() -> int:
    with open('/proc/self/io') as f:
        return int(dict(line.split(': ') for line in f.read().splitlines())['rchar'])


def write_split(data_dir: str, num_shards: int, records: int) -> None:
    if len(tf.io.gfile.glob(tfrecord.file_pattern(data_dir, tfrecord.TRAIN))) == num_shards:
        return
    shutil.rmtree(data_dir, ignore_errors=True)
    os.makedirs(data_dir)
    rng = np.random.default_rng(0)
    jpegs = [tf.io.encode_jpeg(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).numpy() for _ in range(64)]
    started = time.perf_counter()
    for shard in range(num_shards):
        examples = (tfrecord.make_example(jpegs[(shard + i) % len(jpegs)], i % 10 + 1, 32, 32)
                    for i in range(records))
        tfrecord.write_shard(os.path.join(data_dir, tfrecord.shard_name(tfrecord.TRAIN, shard, num_shards)),
                             examples)
        if (shard + 1) % 128 == 0:
            print(f'wrote {shard + 1}/{num_shards} shards ({time.perf_counter() - started:.0f} s)', flush=True)


def count_by_reading(paths: list) -> int:
    files = tf.data.Dataset.from_tensor_slices(paths)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=16, num_parallel_calls=tf.data.AUTOTUNE)
    return int(records.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))


def old_scan_file(path: str) -> tuple:
    """record_counts.scan_file as it was, for a non-local file: seeks through tf.io.gfile.GFile to each record's
    length field and reads its 8 bytes (GFile refills its 512 KiB buffer after a seek that leaves it)."""
    size = tf.io.gfile.stat(path).length
    count, offset = 0, 0
    with tf.io.gfile.GFile(path, 'rb') as f:
        while offset + record_counts.FRAME_BYTES <= size:
            f.seek(offset)
            header = f.read(8)
            if len(header) < 8:
                break
            length, = struct.unpack('<Q', header)
            if offset + record_counts.FRAME_BYTES + length > size:
                break
            offset += record_counts.FRAME_BYTES + length
            count += 1
    return count, offset == size


def time_remote_counting(num_shards: int, records: int, record_bytes: int, rounds: int) -> dict:
    """Seconds (medians over ``rounds``) to count ``num_shards`` non-local shards the old way and the new."""
    remote_dir = _REMOTE_DIR.value
    if tf.io.gfile.exists(remote_dir):
        tf.io.gfile.rmtree(remote_dir)
    tf.io.gfile.makedirs(remote_dir)
    record = np.random.default_rng(0).integers(0, 256, record_bytes, dtype=np.uint8).tobytes()
    paths = [f'{remote_dir}/{tfrecord.shard_name(tfrecord.TRAIN, shard, num_shards)}'
             for shard in range(num_shards)]
    started = time.perf_counter()
    for path in paths:
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(records):
                writer.write(record)
    data_bytes = sum(tf.io.gfile.stat(path).length for path in paths)
    print(f'wrote {num_shards} shards of {records} records of {record_bytes:,} bytes to {remote_dir} '
          f'({data_bytes / 2 ** 20:.1f} MiB, {time.perf_counter() - started:.1f} s)', flush=True)
    total = num_shards * records
    candidates = {
        'remote_seek': lambda: sum(old_scan_file(path)[0] for path in paths),
        'remote_seek_parallel': lambda: sum(count for count, _ in pool.map(old_scan_file, paths)),
        'remote_blocks': lambda: sum(record_counts.count_files(paths, workers=1)),
        'remote_parallel': lambda: sum(record_counts.count_files(paths)),
    }
    timings = {name: [] for name in candidates}
    with concurrent.futures.ThreadPoolExecutor(record_counts.REMOTE_WORKERS) as pool:
        for round_number in range(rounds):
            for name, run in candidates.items():
                started = time.perf_counter()
                assert run() == total, name
                timings[name].append(time.perf_counter() - started)
                print(f'round {round_number + 1}: {name:20s} {timings[name][-1]:8.3f} s', flush=True)
    tf.io.gfile.rmtree(remote_dir)
    result = {'remote_shards': num_shards, 'remote_records': total, 'remote_record_bytes': record_bytes,
              'remote_data_mib': round(data_bytes / 2 ** 20, 1), 'remote_workers': record_counts.REMOTE_WORKERS}
    for name in candidates:
        result[f'{name}_seconds'] = round(statistics.median(timings[name]), 4)
    seek, parallel = result['remote_seek_seconds'], result['remote_parallel_seconds']
    result['remote_seek_over_parallel'] = round(seek / parallel, 2)
    result['remote_seek_over_blocks'] = round(seek / result['remote_blocks_seconds'], 2)
    print(f'counting {num_shards} shards on {remote_dir.split("://")[0]}://: old (seek per record, one file after '
          f'another) {seek:.3f} s, new (blocks, {record_counts.REMOTE_WORKERS} files at once) {parallel:.3f} s: '
          f'old / new = {seek / parallel:.2f}; blocks one file after another {result["remote_blocks_seconds"]:.3f} s, '
          f'seek per record in parallel {result["remote_seek_parallel_seconds"]:.3f} s', flush=True)
    return result


def time_local(data_dir: str, num_shards: int, records: int, rounds: int) -> dict:
    """The local split's figures (see the module's docstring)."""
    write_split(data_dir, num_shards, records)
    paths = record_io.list_shards(data_dir, tfrecord.TRAIN)
    sizes = record_io.file_sizes(paths)
    counts_file = record_counts.path_in(data_dir)
    total = num_shards * records
    config = Config(data_dir=data_dir, num_classes=10, label_offset=1, image_size=32, global_batch_size=64,
                    num_train_images=total, shuffle_buffer=1024, seed=0, deterministic=True)

    def reading():
        assert count_by_reading(paths) == total

    def walk():
        if tf.io.gfile.exists(counts_file):
            tf.io.gfile.remove(counts_file)
        assert sum(record_counts.lookup(paths, sizes, data_dir, None, print)) == total

    def from_file():
        assert sum(record_counts.lookup(paths, sizes, data_dir, None, print)) == total

    def first_batch():
        next(iter(input_pipeline.train_dataset(config, start_step=_RESUME_STEP.value, log=print)))

    candidates = {'reading': reading, 'walk': walk, 'file': from_file, 'first_batch': first_batch}
    timings = {name: [] for name in candidates}
    reads = {name: [] for name in candidates}
    for round_number in range(rounds):
        for name, run in candidates.items():
            if name in ('file', 'first_batch') and not tf.io.gfile.exists(counts_file):
                record_counts.write_beside(data_dir)
            before, started = bytes_read(), time.perf_counter()
            run()
            timings[name].append(time.perf_counter() - started)
            reads[name].append(bytes_read() - before)
            print(f'round {round_number + 1}: {name:11s} {timings[name][-1]:8.3f} s, '
                  f'{reads[name][-1] / 2 ** 20:9.2f} MiB read', flush=True)
    data_bytes = sum(sizes)
    result = {'num_shards': len(paths), 'records': total, 'data_mib': round(data_bytes / 2 ** 20, 1),
              'resume_step': _RESUME_STEP.value}
    for name in candidates:
        result[f'{name}_seconds'] = round(statistics.median(timings[name]), 4)
        result[f'{name}_mib_read'] = round(statistics.median(reads[name]) / 2 ** 20, 3)
    print(f'data: {len(paths)} shards, {total:,} records, {data_bytes / 2 ** 20:.1f} MiB; resume start-up = '
          'counts + first batch: ' + ', '.join(
              f'{name} {result[name + "_seconds"] + result["first_batch_seconds"]:.2f} s'
              for name in ('reading', 'walk', 'file')), flush=True)
    return result


def main(argv):
    del argv
    print(runtime.describe(runtime.report()))
    result = {}
    if _LOCAL.value:
        result.update(time_local(_DATA_DIR.value, _NUM_SHARDS.value, _RECORDS.value, _ROUNDS.value))
    result.update(time_remote_counting(_NUM_SHARDS.value, _REMOTE_RECORDS.value, _REMOTE_RECORD_BYTES.value,
                                       _ROUNDS.value))
    print(json.dumps(result))


if __name__ == '__main__':
    app.run(main)
