"""Input pipeline: evaluation sees every image once with the centre crop; training batches; bad data."""

import dataclasses
import os
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf
import tf_keras

import helpers
from imagenet_tpu import builders, errors
from imagenet_tpu.data import eval_input, input_pipeline
from imagenet_tpu.data import preprocessing
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord
from imagenet_tpu.config import Config

helpers.use_eight_cpus()


def _config(data_dir, **overrides):
    base = Config(data_dir=data_dir, num_classes=4, label_offset=1, image_size=16, global_batch_size=8,
                  eval_batch_size=8, num_train_images=48, num_eval_images=20, shuffle_buffer=16, seed=0)
    return dataclasses.replace(base, **overrides)


class InputPipelineTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'data')
        self.written = helpers.write_dataset(self.data_dir)

    def test_eval_covers_every_image_once_with_centre_crop(self):
        config = _config(self.data_dir)
        batches = list(eval_input.eval_dataset(config))
        images = np.concatenate([b[0].numpy() for b in batches])
        labels = np.concatenate([b[1].numpy() for b in batches])
        weights = np.concatenate([b[2].numpy() for b in batches])
        # 20 images in 3 full batches of 8: the last 4 slots are padding of weight 0, nothing is dropped.
        self.assertEqual([len(b[1]) for b in batches], [8, 8, 8])
        self.assertAllEqual(weights, [1] * 20 + [0] * 4)
        self.assertAllEqual(images[20:], np.zeros_like(images[20:]))
        labels = labels[:20]
        source_images, source_labels = self.written['validation']
        # Files are read in order; shard s holds images s, s + 2, ... (see helpers.write_dataset).
        order = np.concatenate([np.arange(s, 20, 2) for s in range(2)])
        self.assertAllEqual(labels, source_labels[order] - 1)
        # Reference: decode the whole JPEG, crop 87.5% of the shorter side in NumPy, resize (pixels 0..255).
        encoded = tf.io.encode_jpeg(source_images[order[0]], quality=95)
        full = tf.io.decode_jpeg(encoded, dct_method='INTEGER_ACCURATE').numpy()
        side = int(0.875 * min(full.shape[:2]))
        top, left = (full.shape[0] - side + 1) // 2, (full.shape[1] - side + 1) // 2
        crop = full[top:top + side, left:left + side].astype(np.float32)
        expected = tf.image.resize(crop, [16, 16])
        self.assertAllClose(images[0], expected, atol=1e-3)

    def test_eval_with_two_input_pipelines_sees_each_image_exactly_once(self):
        # 20 images, eval batch 8 over 4 replicas on 2 hosts: each host runs 3 steps of 2 x 2 images.
        config = _config(self.data_dir)
        self.assertEqual(config.eval_steps_for(2), 3)
        seen = []
        for host in range(2):
            context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=host,
                                                 num_replicas_in_sync=4)
            batches = list(eval_input.eval_dataset(config, context))
            self.assertLen(batches, 3 * 2)   # steps x replicas per host, all full
            for images, _, weights in batches:
                self.assertEqual(len(weights), 2)
                seen += [image for image, weight in zip(images.numpy(), weights.numpy()) if weight == 1]
        self.assertLen(seen, 20)
        # Identify each image by its pixels: every validation image once, none twice.
        fingerprints = sorted(round(float(np.sum(image)), 2) for image in seen)
        expected = sorted(round(float(np.sum(preprocessing.preprocess_for_eval(
            tf.io.encode_jpeg(image, quality=95), 16))), 2) for image in self.written['validation'][0])
        self.assertAllClose(fingerprints, expected, atol=0.05)
        self.assertLen(set(fingerprints), 20)

    def test_training_files_are_split_between_hosts(self):
        paths = record_io.list_shards(self.data_dir, 'train')
        shares = [input_pipeline.pipeline_files(paths, tf.distribute.InputContext(2, host, 4))
                  for host in range(2)]
        self.assertEqual(set(shares[0]) & set(shares[1]), set())
        self.assertEqual(sorted(shares[0] + shares[1]), sorted(paths))

    def test_train_batches_are_pixels_and_labels_shifted(self):
        config = _config(self.data_dir)
        images, labels = next(iter(input_pipeline.train_dataset(config)))
        self.assertEqual(images.shape, (8, 16, 16, 3))
        self.assertEqual(images.dtype, tf.float32)
        self.assertEqual(labels.dtype, tf.int32)
        # Pixels in 0..255 (the network standardizes them), spread over the range rather than constant.
        self.assertTrue(np.all(images.numpy() >= 0) and np.all(images.numpy() <= 255))
        self.assertGreater(float(np.std(images.numpy())), 10)

        # Labels: on-disk labels 3..6 with label_offset=3, so a shift by anything else (or none) is seen. With
        # the whole image as the crop (random_crop_min_area=1), each training image is its source image resized,
        # perhaps mirrored: matched to it, its label must be that source's on-disk label minus 3.
        shifted_dir = os.path.join(self.get_temp_dir(), 'labels_from_3')
        source_images, disk_labels = helpers.write_dataset(shifted_dir, label_offset=3)['train']
        self.assertCountEqual(set(disk_labels), [3, 4, 5, 6])
        config = _config(shifted_dir, label_offset=3, random_crop_min_area=1.0, deterministic=True)
        batches = list(input_pipeline.train_dataset(config).take(6))     # one data epoch: 48 images
        images = np.concatenate([images.numpy() for images, _ in batches])
        labels = np.concatenate([labels.numpy() for _, labels in batches])
        # Reference: each JPEG as helpers.write_dataset encodes it, decoded whole and resized, as it is and mirrored.
        decoded = np.stack([tf.io.decode_jpeg(tf.io.encode_jpeg(image, quality=95), dct_method='INTEGER_ACCURATE')
                            for image in source_images]).astype(np.float32)
        resized = tf.image.resize(decoded, [16, 16]).numpy()
        candidates = np.concatenate([resized, resized[:, :, ::-1]])
        distances = np.abs(images[:, np.newaxis] - candidates[np.newaxis]).mean(axis=(2, 3, 4))
        source = distances.argmin(axis=1) % len(source_images)
        self.assertLess(distances.min(axis=1).max(), 0.01)    # the same pixels (any other image: 25+ levels)
        self.assertCountEqual(source, range(48))              # every training image once in the epoch
        self.assertAllEqual(labels, disk_labels[source] - 3)

    def test_a_resumed_stream_continues_exactly_where_the_steps_left_it(self):
        # 48 images per epoch in 4 files, read 2 files per round; 2 replicas of 4: 6 steps per epoch. Resuming
        # after step k must give the batches an uninterrupted stream gives from batch 2k on: in the first round,
        # mid-epoch in the second round, at an epoch end, and epochs later.
        config = _config(self.data_dir, deterministic=True, interleave_cycle_length=2)
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
        stream = [images.numpy() for images, _ in input_pipeline.train_dataset(config, context).take(44)]
        for step in (1, 4, 6, 17):
            resumed = [images.numpy() for images, _ in
                       input_pipeline.train_dataset(config, context, start_step=step).take(4)]
            for index, batch in enumerate(resumed):
                self.assertAllEqual(batch, stream[2 * step + index], msg=f'step {step}, batch {index}')
        # Different data epochs are different orders, not one order repeated.
        self.assertNotAllClose(stream[0], stream[12])

    def test_each_pipelines_resumed_stream_continues_its_own_stream(self):
        # 2 pipelines of one replica each, 2 files (24 images) apiece: a step takes 4 records from each.
        config = _config(self.data_dir, deterministic=True)
        for pipeline in (0, 1):
            context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline,
                                                 num_replicas_in_sync=2)
            stream = [images.numpy() for images, _ in input_pipeline.train_dataset(config, context).take(20)]
            for step in (3, 6, 13):
                resumed = [images.numpy() for images, _ in
                           input_pipeline.train_dataset(config, context, start_step=step).take(3)]
                for index, batch in enumerate(resumed):
                    self.assertAllEqual(batch, stream[step + index], msg=f'pipeline {pipeline}, step {step}')

    def test_pipelines_over_identical_files_draw_different_augmentations(self):
        # Every file holds the same 24 records, so pipelines that drew the same crops and flips for the same
        # records would hand out identical images (before the pipeline id was part of the seed: all of them).
        same_dir = os.path.join(self.get_temp_dir(), 'identical_shards')
        os.makedirs(same_dir, exist_ok=True)
        images = [helpers.photo_like(40, 48, seed) for seed in range(24)]
        examples = [tfrecord.make_example(tf.io.encode_jpeg(image).numpy(), index % 4 + 1, 40, 48)
                    for index, image in enumerate(images)]
        for shard in range(2):
            tfrecord.write_shard(os.path.join(same_dir, tfrecord.shard_name('train', shard, 2)), examples)
        config = _config(same_dir, deterministic=True, num_train_images=24)
        streams = []
        for pipeline in (0, 1):
            context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline,
                                                 num_replicas_in_sync=2)
            batches = input_pipeline.train_dataset(config, context).take(12)   # two data epochs
            streams.append(np.concatenate([images.numpy() for images, _ in batches]))
        shared = sum(any(np.array_equal(image, other) for other in streams[0]) for image in streams[1])
        self.assertLess(shared / len(streams[1]), 0.10, f'{shared} of {len(streams[1])} images repeated')

    def test_training_crops_ignore_the_boxes_unless_asked(self):
        # The same photos written twice: with a small box in a corner, and with no box. tensorflow/tpu, the MLPerf
        # submissions and tf-models-official sample the crop against the whole image (a constant box), so by
        # default both sets must give the same crops; with crop_boxes the corner box steers them.
        streams = {}
        for name, boxes in (('boxed', [(0.0, 0.0, 0.2, 0.2)]), ('plain', [])):
            data_dir = os.path.join(self.get_temp_dir(), f'crop_{name}')
            os.makedirs(data_dir, exist_ok=True)
            examples = [tfrecord.make_example(tf.io.encode_jpeg(helpers.photo_like(48, 64, seed)).numpy(), 1, 48, 64,
                                              boxes=boxes) for seed in range(8)]
            tfrecord.write_shard(os.path.join(data_dir, tfrecord.shard_name('train', 0, 1)), examples)
            for crop_boxes in (False, True):
                config = _config(data_dir, deterministic=True, num_train_images=8, crop_boxes=crop_boxes)
                streams[name, crop_boxes] = np.concatenate(
                    [images.numpy() for images, _ in input_pipeline.train_dataset(config).take(2)])
        self.assertAllEqual(streams['boxed', False], streams['plain', False])
        self.assertAllEqual(streams['plain', True], streams['plain', False])   # no box: the whole image either way
        self.assertNotAllClose(streams['boxed', True], streams['boxed', False])

    def test_per_replica_batches_under_a_strategy(self):
        strategy = helpers.mirrored(4)
        config = _config(self.data_dir)
        dataset = strategy.distribute_datasets_from_function(lambda ctx: input_pipeline.train_dataset(config, ctx))
        images, _ = next(iter(dataset))
        self.assertEqual([v.shape[0] for v in strategy.experimental_local_results(images)], [2, 2, 2, 2])

    def test_label_outside_model_range_is_a_clear_error(self):
        config = _config(self.data_dir, num_classes=3)  # disk label 4 (in train shard 3) -> model label 3, out of range
        with self.assertRaisesRegex(errors.DataError, r'on-disk label 4 is outside \[1, 4\)'):
            record_io.check_labels(record_io.list_shards(self.data_dir, 'train')[3], config.num_classes,
                                   config.label_offset, config.bad_records == 'fatal')
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'label out of range'):
            for _ in eval_input.eval_dataset(dataclasses.replace(config, bad_records='fatal')):
                pass
        # Skipping instead: the 5 validation images of label 4 are counted, the other 15 evaluated.
        counts = record_io.SkipCounts()
        weights = [b[2].numpy() for b in eval_input.eval_dataset(config, skip_counts=counts)]
        self.assertEqual(np.sum(weights), 15)
        self.assertEqual(counts.totals(), {'bad_records': 5, 'truncated_files': 0})

    def test_the_label_check_reads_every_label_and_names_an_unreadable_record(self):
        # The check parses a shard's first records in one call; one record it cannot parse makes it read them one
        # at a time: skipped (bad_records=skip), or an error naming that record (fatal); a label outside the range
        # after it is still found.
        path = os.path.join(self.get_temp_dir(), 'train-00000-of-00001')
        good = lambda label: tfrecord.make_example(b'not a jpeg', label, 8, 8).SerializeToString()
        with tf.io.TFRecordWriter(path) as writer:
            for record in (good(1), good(2), b'not a record', good(3), good(7)):
                writer.write(record)
        self.assertEqual(tfrecord.read_labels(os.path.join(self.data_dir, 'train-00003-of-00004')),
                         [int(tf.train.Example.FromString(record.numpy()).features.feature['image/class/label']
                              .int64_list.value[0]) for record in
                          tf.data.TFRecordDataset(os.path.join(self.data_dir, 'train-00003-of-00004'))])
        record_io.check_labels(path, num_classes=7, label_offset=1, fatal_errors=False, records=4)
        with self.assertRaisesRegex(errors.DataError, r'on-disk label 7 is outside \[1, 5\)'):
            record_io.check_labels(path, num_classes=4, label_offset=1, fatal_errors=False)
        with self.assertRaisesRegex(errors.DataError, 'bad input record: .*record 2 cannot be read'):
            record_io.check_labels(path, num_classes=7, label_offset=1, fatal_errors=True)

    def test_missing_and_empty_data_dir(self):
        with self.assertRaisesRegex(errors.DataError, 'does not exist'):
            record_io.list_shards(os.path.join(self.data_dir, 'nope'), 'train')
        empty = os.path.join(self.get_temp_dir(), 'empty')
        os.makedirs(empty, exist_ok=True)
        with self.assertRaisesRegex(errors.DataError, 'no train files matching train-\\*-of-\\*'):
            record_io.list_shards(empty, 'train')

    def test_resize_setting_reaches_training_and_evaluation(self):
        config = _config(self.data_dir, deterministic=True)
        bicubic = dataclasses.replace(config, resize_method='bicubic')
        for stream in (input_pipeline.train_dataset, eval_input.eval_dataset):
            first = next(iter(stream(config)))[0].numpy()
            again = next(iter(stream(config)))[0].numpy()
            other = next(iter(stream(bicubic)))[0].numpy()
            self.assertAllEqual(first, again)          # the same crops: only the filter differs below
            self.assertGreater(float(np.mean(np.abs(other - first))), 0.05, stream.__name__)

    def test_synthetic_batches(self):
        images, labels = next(iter(input_pipeline.synthetic_dataset(_config(None))))
        self.assertEqual(images.shape, (8, 16, 16, 3))
        self.assertTrue(np.all(labels.numpy() < 4))


if __name__ == '__main__':
    tf.test.main()


class EvaluationShardingTest(tf.test.TestCase):
    """On a pod each host reads only its share of the validation files, and every image is evaluated once."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.data_dir = tempfile.mkdtemp(dir=tf.compat.v1.test.get_temp_dir())
        cls.written = helpers.write_dataset(cls.data_dir, num_train=8, num_validation=37, train_shards=1,
                                            validation_shards=8)

    def test_file_shares_balance_records_and_cover_every_file_once(self):
        shares = eval_input.file_shares([5, 5, 4, 4, 4, 4, 4, 4], 4)
        self.assertEqual(sorted(index for share in shares for index in share), list(range(8)))
        self.assertEqual([sum([5, 5, 4, 4, 4, 4, 4, 4][i] for i in share) for share in shares], [9, 9, 8, 8])
        self.assertEqual(eval_input.file_shares([1, 100, 1], 2), [[1], [0, 2]])

    def test_four_hosts_read_a_quarter_of_the_bytes_each_and_see_every_image_once(self):
        config = _config(self.data_dir, num_eval_images=37, eval_batch_size=8)
        paths = record_io.list_shards(self.data_dir, tfrecord.VALIDATION)
        total_bytes = sum(os.path.getsize(path) for path in paths)
        seen, read_bytes = [], []
        for host in range(4):
            context = tf.distribute.InputContext(num_input_pipelines=4, input_pipeline_id=host,
                                                 num_replicas_in_sync=4)
            opened = []
            original = record_io.read_records

            def reading(files, *args, **kwargs):
                opened.extend(files)     # what this host's pipeline reads
                return original(files, *args, **kwargs)

            with mock.patch.object(record_io, 'read_records', reading):
                batches = list(eval_input.eval_dataset(config, context))
            read_bytes.append(sum(os.path.getsize(path) for path in opened))
            self.assertLen(batches, eval_input.eval_steps(config, 4))     # 1 replica per host
            for images, labels_, weights in batches:
                seen += [(round(float(np.sum(image)), 2), int(label))
                         for image, label, weight in zip(images.numpy(), labels_.numpy(), weights.numpy()) if weight]
        # 37 images in 8 files of 4-5: each host reads 2 files, 9 or 10 images, ~1/4 of the bytes.
        for share in read_bytes:
            self.assertBetween(share / total_bytes, 0.2, 0.3)
        self.assertEqual(sum(read_bytes), total_bytes)
        self.assertLen(seen, 37)
        expected = sorted((round(float(np.sum(preprocessing.preprocess_for_eval(
            tf.io.encode_jpeg(image, quality=95), 16))), 2), int(label) - 1)
            for image, label in zip(*self.written['validation']))
        self.assertAllClose(sorted(seen), expected, atol=0.05)
        self.assertEqual(eval_input.eval_steps(config, 4), 5)   # the largest share, 10 images, 2 per step

    def test_fewer_files_than_hosts_shares_by_record(self):
        config = _config(self.data_dir, num_eval_images=37, eval_batch_size=16)
        self.assertIsNone(eval_input.validation_split(config, 16).shares)
        self.assertEqual(eval_input.eval_steps(config, 16), config.eval_steps_for(16))


class OneListingTest(tf.test.TestCase):
    """A TPU client builds every host's pipeline: the shards are listed and sized once, not once per host."""

    def test_four_host_pipelines_list_and_stat_the_shards_once(self):
        data_dir = tempfile.mkdtemp(dir=tf.compat.v1.test.get_temp_dir())
        helpers.write_dataset(data_dir, num_train=16, num_validation=4, train_shards=8, validation_shards=1)
        config = _config(data_dir, num_train_images=16)
        built = []
        pod = mock.Mock(distribute_datasets_from_function=lambda make, options: built.extend(
            make(tf.distribute.InputContext(num_input_pipelines=4, input_pipeline_id=host, num_replicas_in_sync=4))
            for host in range(4)))
        globs, listings = mock.Mock(wraps=tf.io.gfile.glob), mock.Mock(wraps=tf.io.gfile.listdir)
        stats = mock.Mock(wraps=tf.io.gfile.stat)
        with mock.patch.object(tf.io.gfile, 'glob', globs), mock.patch.object(tf.io.gfile, 'listdir', listings), \
                mock.patch.object(tf.io.gfile, 'stat', stats):
            builders.build_train_dataset(config, pod)
        self.assertLen(built, 4)
        folder_listings = [call for call in globs.call_args_list + listings.call_args_list if data_dir in str(call)]
        self.assertLen(folder_listings, 1)
        training_stats = [call for call in stats.call_args_list if 'train-' in str(call)]
        # Each shard sized once when listed, then counted by its own host's pipeline (record_counts.py).
        self.assertLessEqual(len(training_stats), 2 * 8)


class SeedZeroTest(tf.test.TestCase):
    """--seed=0 sets TensorFlow's global seed to 0, which TensorFlow's shuffle cannot combine with a tensor seed
    (found by rehearsing the recipes, which state no seed); the order depends on the run's seed alone."""

    def test_seed_0_trains_and_the_order_ignores_the_global_seed(self):
        data_dir = tempfile.mkdtemp(dir=tf.compat.v1.test.get_temp_dir())
        helpers.write_dataset(data_dir, num_train=16, num_validation=4, train_shards=2, validation_shards=1)
        for cached in ('none', 'records'):
            config = _config(data_dir, seed=0, num_train_images=16, deterministic=True, input_cache=cached)
            orders = []
            for global_seed in (0, 12345):
                tf_keras.utils.set_random_seed(global_seed)
                orders.append(next(iter(input_pipeline.train_dataset(config)))[1].numpy())
            self.assertAllEqual(orders[0], orders[1])
