"""Bad input records: a corrupt JPEG, a truncated JPEG, a record missing a feature and a TFRecord file cut
mid-record (helpers.write_bad_dataset) are skipped and counted (every good image still seen once per epoch), or
stop the run when set."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu.data import eval_input, input_pipeline
from imagenet_tpu.data import record_io, tfrecord
from imagenet_tpu.config import Config

helpers.use_eight_cpus()

NUM_GOOD = helpers.NUM_GOOD_RECORDS


def _config(data_dir, **overrides):
    base = Config(data_dir=data_dir, num_classes=NUM_GOOD, label_offset=1, image_size=16, global_batch_size=4,
                  eval_batch_size=4, num_train_images=NUM_GOOD, num_eval_images=NUM_GOOD, shuffle_buffer=32,
                  seed=3, deterministic=True)
    return dataclasses.replace(base, **overrides)


class BadRecordsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'bad')
        self.good_labels = helpers.write_bad_dataset(self.data_dir)

    def test_training_skips_and_counts_bad_records_and_sees_every_good_image(self):
        counts = record_io.SkipCounts()
        dataset = input_pipeline.train_dataset(_config(self.data_dir), skip_counts=counts)
        # One data epoch is the 16 good images: 4 batches of 4.
        batches = [labels.numpy() for _, labels in dataset.take(5)]
        self.assertCountEqual(np.concatenate(batches[:4]) + 1, self.good_labels)
        totals = counts.totals()
        # A bad record is counted when the next good one is decoded: with a batch of the next epoch taken, all
        # of this epoch's faults are counted, and perhaps some of the next epoch's. Files are read up to two
        # shuffle windows ahead of decoding (here 32 records each, in epochs of 19 records).
        self.assertBetween(totals['bad_records'], 3, 6)
        self.assertBetween(totals['truncated_files'], 1, 3)

    def test_evaluation_counts_exactly(self):
        counts = record_io.SkipCounts()
        batches = list(eval_input.eval_dataset(_config(self.data_dir), skip_counts=counts))
        labels = np.concatenate([b[1].numpy() for b in batches])
        weights = np.concatenate([b[2].numpy() for b in batches])
        self.assertCountEqual(labels[weights == 1] + 1, self.good_labels)
        self.assertEqual(counts.totals(), {'bad_records': 3, 'truncated_files': 1})

    def test_fatal_setting_stops_at_the_first_bad_record(self):
        config = _config(self.data_dir, bad_records='fatal')
        with self.assertRaises((tf.errors.InvalidArgumentError, tf.errors.DataLossError)):
            for _ in eval_input.eval_dataset(config):
                pass
        with self.assertRaises((tf.errors.InvalidArgumentError, tf.errors.DataLossError)):
            for _ in input_pipeline.train_dataset(config).take(8):
                pass

    def test_decoded_image_cache_skips_the_same_records(self):
        counts = record_io.SkipCounts()
        dataset = input_pipeline.train_dataset(_config(self.data_dir, input_cache='images'), skip_counts=counts)
        labels = np.concatenate([labels.numpy() for _, labels in dataset.take(8)])
        # Two epochs from the cache: each good image twice; the faults were met once, when the cache filled.
        self.assertCountEqual(labels + 1, self.good_labels * 2)
        self.assertEqual(counts.totals(), {'bad_records': 3, 'truncated_files': 1})


if __name__ == '__main__':
    tf.test.main()


@pytest.mark.faults
class QuietBadRecordsTest(tf.test.TestCase):
    """Records that are not JPEGs are skipped and counted without libjpeg printing a line for each."""

    def test_png_records_are_counted_without_a_line_each(self):
        data_dir = self.get_temp_dir()
        png = tf.io.encode_png(helpers.photo_like(20, 24, 0)).numpy()
        jpeg = tf.io.encode_jpeg(helpers.photo_like(20, 24, 1)).numpy()
        examples = [tfrecord.make_example(png, 1, 20, 24)] * 12 + [tfrecord.make_example(jpeg, 2, 20, 24)] * 4
        for split in (tfrecord.TRAIN, tfrecord.VALIDATION):
            tfrecord.write_shard(os.path.join(data_dir, tfrecord.shard_name(split, 0, 1)), examples)
        script = textwrap.dedent(f'''
            from imagenet_tpu.config import Config
            from imagenet_tpu.data import eval_input
            from imagenet_tpu.data.record_io import SkipCounts
            counts = SkipCounts()
            config = Config(data_dir={data_dir!r}, num_classes=4, image_size=16, eval_batch_size=8,
                            num_eval_images=16)
            batches = list(eval_input.eval_dataset(config, skip_counts=counts))
            print('bad records', counts.totals()['bad_records'])
            ''')
        result = subprocess.run([sys.executable, '-c', script], env=helpers.subprocess_environment(),
                                capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn('bad records 12', result.stdout)
        self.assertNotIn('Not a JPEG file', result.stderr)
