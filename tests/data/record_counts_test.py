"""Record counts: counting from the length fields, the counts file beside the shards and its cache in model_dir
(used for remote files; local files are counted at every resume), stale, impossible and wrong entries, and a
resumed stream that reads only where it resumes."""

import dataclasses
import os
import shutil
import threading
import time
from unittest import mock

import tensorflow as tf

import helpers
from imagenet_tpu import errors
from imagenet_tpu.data import input_pipeline
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import tfrecord
from imagenet_tpu.config import Config


def _records_read(path: str) -> int:
    """Whole records TensorFlow's own reader returns before the end or a cut."""
    return sum(1 for _ in tf.data.TFRecordDataset(path).ignore_errors())


def _bytes_read() -> int:
    with open('/proc/self/io') as f:
        return int(dict(line.split(': ') for line in f.read().splitlines())['rchar'])


def _as_remote():
    """Treats every path as remote (gs://...) within the block: the counts files are then trusted."""
    return mock.patch.object(record_counts, 'is_local', lambda path: False)


def _config(data_dir, **overrides):
    base = Config(data_dir=data_dir, num_classes=4, label_offset=1, image_size=16, global_batch_size=8,
                  num_train_images=48, shuffle_buffer=16, seed=0, deterministic=True, interleave_cycle_length=2)
    return dataclasses.replace(base, **overrides)


class RecordCountsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'data')
        shutil.rmtree(self.data_dir, ignore_errors=True)
        helpers.write_dataset(self.data_dir, num_train=48, train_shards=4)
        self.paths = sorted(tf.io.gfile.glob(os.path.join(self.data_dir, 'train-*')))
        self.sizes = [os.path.getsize(path) for path in self.paths]
        self.model_dir = os.path.join(self.get_temp_dir(), 'model')
        shutil.rmtree(self.model_dir, ignore_errors=True)

    def test_counts_agree_with_the_reader_also_for_a_file_cut_mid_record(self):
        cut = os.path.join(self.get_temp_dir(), 'cut')
        with open(self.paths[0], 'rb') as f:
            content = f.read()
        with open(cut, 'wb') as f:
            f.write(content[:-100])
        for path in (self.paths[0], cut):
            self.assertEqual(record_counts.count_file(path), _records_read(path), path)
        self.assertEqual(record_counts.count_file(cut), record_counts.count_file(self.paths[0]) - 1)

    def test_the_file_beside_the_shards_is_used_and_a_changed_file_counted_again(self):
        written = record_counts.write_beside(self.data_dir)
        entries = record_counts.read(written)
        self.assertEqual(entries['train-00000-of-00004'], (12, self.sizes[0]))
        self.assertEqual(entries['validation-00001-of-00002'][0], 10)
        # A shard rewritten with one record more: its recorded size no longer matches.
        examples = [tf.train.Example.FromString(record.numpy()) for record in tf.data.TFRecordDataset(self.paths[1])]
        tfrecord.write_shard(self.paths[1], examples + examples[:1])
        sizes = [os.path.getsize(path) for path in self.paths]
        lines = []
        with mock.patch.object(record_counts, 'count_file', wraps=record_counts.count_file) as count, _as_remote():
            counts = record_counts.lookup(self.paths, sizes, self.data_dir, self.model_dir, lines.append)
        self.assertEqual(counts, [12, 13, 12, 12])
        self.assertEqual([call.args[0] for call in count.call_args_list], [self.paths[1]])   # the others not read
        self.assertLen(lines, 1)
        self.assertIn(f'{self.paths[1]} {self.sizes[1]} bytes but it has {sizes[1]}', lines[0])
        self.assertEqual(record_counts.read(record_counts.path_in(self.model_dir)),
                         {self.paths[1]: (13, sizes[1])})

    def test_remote_shards_without_a_counts_file_are_counted_once_then_read_from_the_cache(self):
        with _as_remote():
            first = record_counts.lookup(self.paths, self.sizes, self.data_dir, self.model_dir, print)
            self.assertEqual(first, [_records_read(path) for path in self.paths])
            with mock.patch.object(record_counts, 'count_file', side_effect=AssertionError('counted again')):
                self.assertEqual(record_counts.lookup(self.paths, self.sizes, self.data_dir, self.model_dir, print),
                                 first)

    def test_local_shards_are_counted_whatever_the_counts_file_says(self):
        # Counts with the right byte sizes but wrong numbers (more, fewer, zero, negative) moved a resume before.
        wrong = [1180, 3, 0, -500]
        record_counts.write(record_counts.path_in(self.data_dir),
                            {os.path.basename(path): (count, size)
                             for path, size, count in zip(self.paths, self.sizes, wrong)})
        lines = []
        counts = record_counts.lookup(self.paths, self.sizes, self.data_dir, self.model_dir, lines.append)
        self.assertEqual(counts, [_records_read(path) for path in self.paths])
        self.assertLen(lines, 4)
        for count in (1180, 0, -500):
            self.assertTrue(any(f' {count} records, impossible' in line for line in lines), (count, lines))
        self.assertTrue(any('3 records but it holds 12' in line for line in lines), lines)

    def test_impossible_remote_counts_are_counted_instead(self):
        wrong = [10 ** 9, 0, -500, 12]
        record_counts.write(record_counts.path_in(self.data_dir),
                            {os.path.basename(path): (count, size)
                             for path, size, count in zip(self.paths, self.sizes, wrong)})
        lines = []
        with _as_remote():
            counts = record_counts.lookup(self.paths, self.sizes, self.data_dir, None, lines.append)
        self.assertEqual(counts, [12] * 4)
        self.assertLen(lines, 3)

    def test_a_malformed_counts_file_is_reported_and_not_used(self):
        with open(record_counts.path_in(self.data_dir), 'w') as f:
            f.write('train-00000-of-00004\ttwelve\n')
        lines = []
        self.assertEqual(record_counts.lookup(self.paths, self.sizes, self.data_dir, None, lines.append),
                         [12] * 4)
        self.assertIn('line 1', lines[0])

    def test_a_wrong_remote_count_with_the_right_size_is_an_error_where_the_run_resumes(self):
        record_counts.write(record_counts.path_in(self.data_dir),
                            {os.path.basename(path): (11, size) for path, size in zip(self.paths, self.sizes)})
        with self.assertRaisesRegex(errors.DataError, 'gives .* 11 records but it holds 12'), _as_remote():
            input_pipeline.train_dataset(_config(self.data_dir), start_step=3)

    def test_a_wrong_local_count_does_not_move_the_resume(self):
        config = _config(self.data_dir)
        iterator = iter(input_pipeline.train_dataset(config, start_step=3))
        expected = [next(iterator)[1].numpy() for _ in range(3)]
        record_counts.write(record_counts.path_in(self.data_dir),
                            {os.path.basename(path): (11, size) for path, size in zip(self.paths, self.sizes)})
        iterator = iter(input_pipeline.train_dataset(config, start_step=3, log=lambda line: None))
        self.assertAllEqual([next(iterator)[1].numpy() for _ in range(3)], expected)

    def test_a_resumed_stream_reads_only_the_files_where_it_resumes(self):
        # 32 shards of 12 records, 2 files per round: a fresh stream's first batch reads its first rounds; a
        # stream resumed deep into the epoch must read about as much, not the whole set (as counting by reading
        # every record did, before resuming) nor the records before its place.
        data_dir = os.path.join(self.get_temp_dir(), 'many')
        shutil.rmtree(data_dir, ignore_errors=True)
        helpers.write_dataset(data_dir, num_train=384, train_shards=32, size=64, num_validation=2)
        record_counts.write_beside(data_dir)
        total = sum(os.path.getsize(path) for path in tf.io.gfile.glob(os.path.join(data_dir, 'train-*')))
        config = _config(data_dir, num_train_images=384)

        def first_batch_bytes(start_step):
            before = _bytes_read()
            iterator = iter(input_pipeline.train_dataset(config, start_step=start_step))
            next(iterator)
            time.sleep(0.5)                      # the pipeline's read-ahead, which counts too
            read = _bytes_read() - before
            del iterator
            return read

        first_batch_bytes(0)                     # traces the functions once (source files are read then)
        fresh, resumed = first_batch_bytes(0), first_batch_bytes(40)   # step 40: record 320 of 384
        self.assertLess(resumed, total / 3, f'{resumed} of {total} bytes read')
        self.assertLess(resumed, 2 * fresh + 100_000, f'fresh {fresh}, resumed {resumed}')


class _CountingGFile(tf.io.gfile.GFile):
    """tf.io.gfile.GFile that records its seeks and reads (class-wide, as the scanner opens its own)."""
    seeks, reads = [], []

    def seek(self, *args, **kwargs):
        _CountingGFile.seeks.append(args)
        return super().seek(*args, **kwargs)

    def read(self, n=-1):
        content = super().read(n)
        _CountingGFile.reads.append((n, len(content)))
        return content


class RemoteRecordCountsTest(tf.test.TestCase):
    """Files on a non-local file system (TensorFlow's in-memory ram://): read in order in blocks, in parallel."""

    def setUp(self):
        super().setUp()
        self.root = f'ram://record_counts_test/{self.id().rsplit(".", 1)[-1]}'
        tf.io.gfile.makedirs(self.root)
        self.addCleanup(tf.io.gfile.rmtree, self.root)

    def _write(self, name: str, lengths) -> str:
        path = f'{self.root}/{name}'
        with tf.io.TFRecordWriter(path) as writer:
            for number, length in enumerate(lengths):
                writer.write(bytes([number % 256]) * length)
        return path

    def _copy(self, path: str, name: str, end: int) -> str:
        """A copy of the first ``end`` bytes of ``path``."""
        with tf.io.gfile.GFile(path, 'rb') as f:
            content = f.read()
        copy = f'{self.root}/{name}'
        with tf.io.gfile.GFile(copy, 'wb') as f:
            f.write(content[:end])
        return copy

    def test_counts_agree_with_the_reader_for_records_larger_and_smaller_than_a_block(self):
        # Block sizes from 1 byte (every length field split) to more than the file, records from empty to
        # several blocks long, so that length fields and data straddle block boundaries at many offsets.
        lengths = [0, 1, 5, 80, 100, 250, 3, 1000, 0, 84, 85, 99, 7, 400, 2]
        path = self._write('mixed', lengths)
        self.assertEqual(_records_read(path), len(lengths))
        for block_bytes in (1, 7, 16, 100, 101, 4096, record_counts.BLOCK_BYTES):
            self.assertEqual(record_counts.scan_file(path, block_bytes), (len(lengths), True), block_bytes)
        self.assertEqual(record_counts.count_file(path), len(lengths))
        big = self._write('big', [300_000, 5, 200_000])     # records of several 100 KB blocks
        self.assertEqual(record_counts.scan_file(big, 100_000), (3, True))

    def test_a_file_cut_mid_record_counts_its_whole_records_and_an_empty_file_none(self):
        lengths = [30, 120, 0, 60, 250, 10]
        path = self._write('whole', lengths)
        size = tf.io.gfile.stat(path).length
        boundaries = {0}                        # where a record ends
        for length in lengths:
            boundaries.add(max(boundaries) + record_counts.FRAME_BYTES + length)
        ends = [0, 3, 8, 12, 15, 16, 17, 40, 46, 47, 100, size - 27, size - 26, size - 20, size - 4, size - 1]
        for end in ends:
            cut = self._copy(path, f'cut-{end}', end)
            expected = (_records_read(cut), end in boundaries)
            for block_bytes in (1, 10, 100, record_counts.BLOCK_BYTES):
                self.assertEqual(record_counts.scan_file(cut, block_bytes), expected, (end, block_bytes))
            # The same bytes on a local disk, counted by seeking to the length fields, agree.
            local = os.path.join(self.get_temp_dir(), 'cut')
            tf.io.gfile.copy(cut, local, overwrite=True)
            self.assertEqual(record_counts.scan_file(local), expected, end)
        self.assertEqual(record_counts.scan_file(self._copy(path, 'empty', 0)), (0, True))

    def test_a_remote_file_is_read_once_in_order_in_blocks_without_seeking(self):
        # Before, counting seeked to every record's length field: a refill of GFile's 512 KiB buffer each.
        path = self._write('shard', [1000] * 200)
        size = tf.io.gfile.stat(path).length
        _CountingGFile.seeks, _CountingGFile.reads = [], []
        with mock.patch.object(tf.io.gfile, 'GFile', _CountingGFile):
            self.assertEqual(record_counts.scan_file(path), (200, True))
        self.assertEqual(_CountingGFile.seeks, [])
        self.assertEqual(_CountingGFile.reads, [(size, size)])     # one read of the whole file
        _CountingGFile.reads = []
        with mock.patch.object(tf.io.gfile, 'GFile', _CountingGFile):
            self.assertEqual(record_counts.scan_file(path, 4096), (200, True))
        self.assertEqual(_CountingGFile.seeks, [])
        self.assertEqual(sum(read for _, read in _CountingGFile.reads), size)    # every byte once
        self.assertEqual([requested for requested, _ in _CountingGFile.reads],
                         [4096] * (size // 4096) + [size % 4096])

    def test_lookup_counts_remote_files_in_parallel_in_their_order(self):
        num_files = 12
        paths = [self._write(f'train-{index:05d}-of-{num_files:05d}', [50 + index] * (index + 1))
                 for index in range(num_files)]
        sizes = [tf.io.gfile.stat(path).length for path in paths]
        count_file = record_counts.count_file
        lock, running, most = threading.Lock(), [0], [0]

        def slow_count(path):                    # the first files finish last
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.02 * (num_files - paths.index(path)))
            try:
                return count_file(path)
            finally:
                with lock:
                    running[0] -= 1

        model_dir = f'{self.root}/model'
        with mock.patch.object(record_counts, 'count_file', side_effect=slow_count) as count:
            counts = record_counts.lookup(paths, sizes, self.root, model_dir, print)
        self.assertEqual(counts, list(range(1, num_files + 1)))
        self.assertEqual(sorted(call.args[0] for call in count.call_args_list), paths)
        self.assertGreater(most[0], 1)
        self.assertEqual(record_counts.read(record_counts.path_in(model_dir)),
                         {path: (index + 1, size) for index, (path, size) in enumerate(zip(paths, sizes))})
        written = record_counts.read(record_counts.write_beside(self.root))
        self.assertEqual(written, {os.path.basename(path): (index + 1, size)
                                   for index, (path, size) in enumerate(zip(paths, sizes))})
        with self.assertRaises(tf.errors.NotFoundError):
            record_counts.count_files(paths + [f'{self.root}/missing'])
        self.assertEqual(record_counts.count_files(paths[:3], workers=1), [1, 2, 3])
