"""ImageNet as tensorflow_datasets prepares it, read in place: shards written by tensorflow_datasets itself (a small
builder over the same JPEGs as our own shards, prepared here), their record counts from dataset_info.json, their
0-based labels, training, a resume and the evaluation command on them, and top-1 equal to our format's."""

import dataclasses
import io
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu import errors
from imagenet_tpu import evaluate
from imagenet_tpu import train
from imagenet_tpu import builders
from imagenet_tpu.data import labels
from imagenet_tpu.data import record_counts
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord

tfds = pytest.importorskip('tensorflow_datasets')

helpers.use_eight_cpus()

CLASSES = ('n01440764', 'n01443537', 'n01484850', 'n01491361')   # ImageNet's first four synsets


def our_examples(data_dir: str, split: str) -> list:
    """(encoded JPEG, on-disk label, file name) of every record of ``split`` in our shards, in file order."""
    found = []
    for path in record_io.list_shards(data_dir, split):
        for record in tf.data.TFRecordDataset(path):
            example = tfrecord.parse_example(record)
            found.append((example['encoded'].numpy(), int(example['label']), example['filename'].numpy().decode()))
    return found


class Imagenet2012Like(tfds.core.GeneratorBasedBuilder):
    """imagenet2012's features (tensorflow_datasets/image_classification/imagenet.py): an encoded JPEG, a 0-based
    ClassLabel over the synsets and the file name, built from the records of our own shards in ``source``."""
    VERSION = tfds.core.Version('5.1.0')
    source = None

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, supervised_keys=('image', 'label'), features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(encoding_format='jpeg'),
            'label': tfds.features.ClassLabel(names=CLASSES),
            'file_name': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in (tfrecord.TRAIN, tfrecord.VALIDATION)}

    def _generate_examples(self, split):
        for encoded, label, name in our_examples(self.source, split):
            yield name, {'image': io.BytesIO(encoded), 'label': label - 1, 'file_name': name}


class ArrayImages(tfds.core.GeneratorBasedBuilder):
    """Images given to tensorflow_datasets as arrays, which it stores as PNG (its Image feature's default), one
    class per image so that a label names its image."""
    VERSION = tfds.core.Version('1.0.0')
    IMAGES = 8

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, supervised_keys=('image', 'label'), features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3)),
            'label': tfds.features.ClassLabel(num_classes=self.IMAGES)}))

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples() for split in (tfrecord.TRAIN, tfrecord.VALIDATION)}

    def _generate_examples(self):
        for index in range(self.IMAGES):
            yield index, {'image': helpers.photo_like(24, 28, index), 'label': index}


class PngTest(tf.test.TestCase):

    def test_png_images_decode_losslessly_in_evaluation_and_training(self):
        from imagenet_tpu.data import eval_input, input_pipeline
        root = tempfile.mkdtemp(prefix='tfds-png-', dir=self.get_temp_dir())
        builder = ArrayImages(data_dir=root, file_format='tfrecord')
        builder.download_and_prepare()
        config = helpers.tiny_config(data_dir=builder.data_dir, num_classes=8, num_train_images=8, num_eval_images=8,
                                     eval_batch_size=8, global_batch_size=4, bad_records='fatal', image_size=16)
        images, model_classes, weights = next(eval_input.eval_dataset(config).as_numpy_iterator())
        self.assertEqual(sorted(model_classes.tolist()), list(range(8)))
        self.assertAllEqual(weights, np.ones(8))
        for image, model_class in zip(images, model_classes):
            # PNG keeps the pixels: the central 0.875 of the shorter side of the array itself, resized.
            source = helpers.photo_like(24, 28, int(model_class))
            side = int(0.875 * 24)
            top, left = (24 - side + 1) // 2, (28 - side + 1) // 2
            expected = tf.image.resize(source[top:top + side, left:left + side], [16, 16]).numpy()
            self.assertAllClose(image, expected, atol=1e-3)
        batch, labels_ = next(input_pipeline.train_dataset(config).as_numpy_iterator())
        self.assertEqual(batch.shape, (4, 16, 16, 3))
        self.assertTrue(set(labels_.tolist()) <= set(range(8)))


class TfdsLayoutTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='tfds-', dir=tf.compat.v1.test.get_temp_dir())
        cls.ours = os.path.join(cls.root, 'ours')
        helpers.write_dataset(cls.ours, num_classes=4)
        Imagenet2012Like.source = cls.ours
        builder = Imagenet2012Like(data_dir=os.path.join(cls.root, 'tfds'), file_format='tfrecord')
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=2))
        cls.tfds_dir = builder.data_dir        # .../imagenet2012_like/5.1.0
        cls.config = helpers.tiny_config(num_classes=4, checkpoint_every_steps=2, log_every_steps=0, seed=5,
                                         shuffle_buffer=8)

    def test_shards_labels_and_counts_come_from_the_tfds_folder(self):
        layout = tfrecord.layout_of(self.tfds_dir)
        self.assertTrue(layout.tfds)
        self.assertEqual((layout.name, layout.image_key, layout.label_key), ('imagenet2012_like', 'image', 'label'))
        self.assertFalse(tfrecord.layout_of(self.ours).tfds)
        for split, images in ((tfrecord.TRAIN, 48), (tfrecord.VALIDATION, 20)):
            paths = record_io.list_shards(self.tfds_dir, split)
            self.assertEqual([os.path.basename(path) for path in paths],
                             [f'imagenet2012_like-{split}.tfrecord-0000{i}-of-00002' for i in range(2)])
            # The same records as ours: the same JPEG bytes, TFDS's label one less than ours.
            theirs = sorted((example['encoded'].numpy(), int(example['label']))
                            for path in paths for example in map(layout.parse, tf.data.TFRecordDataset(path)))
            self.assertEqual(theirs, sorted((encoded, label) for encoded, label, _ in our_examples(self.ours, split)))
            raw = [int(tf.train.Example.FromString(record.numpy()).features.feature['label'].int64_list.value[0])
                   for path in paths for record in tf.data.TFRecordDataset(path)]
            self.assertEqual(sorted(raw), sorted(label - 1 for _, label in theirs))
            # Record counts: dataset_info.json's shardLengths, which the files' own framing confirms.
            lines = []
            counts = record_counts.lookup(paths, record_io.file_sizes(paths), self.tfds_dir, None, lines.append)
            self.assertEqual(counts, record_counts.count_files(paths))
            self.assertEqual(sum(counts), images)
            self.assertEqual(lines, [])
            self.assertEqual(sum(layout.shard_names(split).values()), images)
        names, ids = labels.class_names(4, 1, self.tfds_dir)
        self.assertEqual(ids, list(CLASSES))

    def test_a_wrong_shard_length_is_reported_and_a_wrong_label_range_stops_at_start(self):
        copy = os.path.join(self.root, 'damaged')
        shutil.copytree(self.tfds_dir, copy)
        info_path = os.path.join(copy, tfrecord.TFDS_INFO)
        with open(info_path) as f:
            info = json.load(f)
        train_split = next(split for split in info['splits'] if split['name'] == tfrecord.TRAIN)
        true_first = int(train_split['shardLengths'][0])
        train_split['shardLengths'][0] = str(true_first + 3)
        with open(info_path, 'w') as f:
            json.dump(info, f)
        paths = record_io.list_shards(copy, tfrecord.TRAIN)
        lines = []
        counts = record_counts.lookup(paths, record_io.file_sizes(paths), copy, None, lines.append)
        self.assertEqual(counts[0], true_first)
        self.assertLen(lines, 1)
        self.assertIn(f'dataset_info.json (shardLengths) gives {paths[0]} {true_first + 3} records but it holds '
                      f'{true_first}', lines[0])
        # Three classes where the shards hold four: the largest TFDS label, 3, is read as 4.
        with self.assertRaisesRegex(errors.DataError, r'tensorflow_datasets label 3, read as 4\) is outside \[1, 4\)'):
            builders.check_data(dataclasses.replace(self.config, data_dir=self.tfds_dir, num_classes=3))
        with open(info_path, 'w') as f:
            f.write('{"name": "x", "fileFormat": "array_record", "splits": []}')
        tfrecord._layout_of.cache_clear()
        with self.assertRaisesRegex(errors.DataError, 'as array_record; only its tfrecord files'):
            record_io.list_shards(copy, tfrecord.TRAIN)

    @pytest.mark.slow
    def test_training_a_resume_and_evaluation_read_them_and_top_1_equals_our_formats(self):
        model_dir = os.path.join(self.root, 'run')
        config = dataclasses.replace(self.config, data_dir=self.tfds_dir, model_dir=model_dir)
        strategy = helpers.mirrored(2)
        first = train.train_and_evaluate(dataclasses.replace(config, train_epochs=2 / 3), strategy,
                                         print_fn=lambda line: None)
        self.assertEqual(first['steps'], 2)
        lines = []
        second = train.train_and_evaluate(config, strategy, print_fn=lines.append)
        self.assertEqual(second['steps'], 3)
        self.assertIn(f'resumed from {model_dir}/checkpoints/ckpt-2 at step 2', lines)
        self.assertEqual([line for line in lines if 'warning' in line], [])
        self.assertEqual(second['eval_images'], 20)
        by_layout = {}
        for name, data_dir in (('tfds', self.tfds_dir), ('ours', self.ours)):
            (by_layout[name],) = evaluate.evaluate_run(evaluate.run_config(model_dir, {'data_dir': data_dir}),
                                                       'latest', strategy, print_fn=lambda line: None)
        self.assertEqual(by_layout['tfds']['images'], 20)
        self.assertAlmostEqual(by_layout['tfds']['top_1'], second['top_1'], places=6)
        self.assertEqual(by_layout['tfds']['top_1'], by_layout['ours']['top_1'])
        self.assertEqual(by_layout['tfds']['top_5'], by_layout['ours']['top_5'])
        # The same logits for every image (the same JPEG bytes, decoded the same way; only the order differs).
        self.assertAllClose(by_layout['tfds']['loss'], by_layout['ours']['loss'], rtol=1e-6)
        self.assertEqual([(row['images'], row['top_1']) for row in by_layout['tfds']['per_class']],
                         [(row['images'], row['top_1']) for row in by_layout['ours']['per_class']])
        self.assertEqual([row['id'] for row in by_layout['tfds']['per_class']], list(CLASSES))
        print(f"top-1 on the TFDS shards {100 * by_layout['tfds']['top_1']:.1f}%, on ours "
              f"{100 * by_layout['ours']['top_1']:.1f}%")
