"""TFRecord schema: write/parse round trip against the raw protobuf, and the label convention."""

import os

import tensorflow as tf

import helpers
from imagenet_tpu.data import tfrecord

helpers.use_eight_cpus()


class TFRecordTest(tf.test.TestCase):

    def test_round_trip_through_a_shard(self):
        image = helpers.photo_like(30, 40, seed=3)
        encoded = tf.io.encode_jpeg(image).numpy()
        boxes = [tfrecord.Box(0.1, 0.2, 0.5, 0.9), tfrecord.Box(0.0, 0.0, 1.0, 1.0)]
        example = tfrecord.make_example(encoded, 417, 30, 40, synset='n01440764', filename='a.JPEG', boxes=boxes)
        path = os.path.join(self.get_temp_dir(), tfrecord.shard_name('train', 0, 1))
        self.assertEqual(tfrecord.write_shard(path, [example, example]), 2)
        self.assertFalse(tf.io.gfile.exists(path + '.incomplete'))

        records = list(tf.data.TFRecordDataset(path))
        self.assertLen(records, 2)
        # Independent reference: the raw protobuf fields under the tensorflow/tpu feature names.
        raw = tf.train.Example.FromString(records[0].numpy()).features.feature
        self.assertEqual(raw['image/encoded'].bytes_list.value[0], encoded)
        self.assertEqual(raw['image/class/label'].int64_list.value[0], 417)
        self.assertEqual(raw['image/class/synset'].bytes_list.value[0], b'n01440764')
        self.assertEqual(list(raw['image/height'].int64_list.value), [30])
        self.assertEqual(list(raw['image/width'].int64_list.value), [40])
        self.assertAllClose(raw['image/object/bbox/xmin'].float_list.value, [0.1, 0.0])
        self.assertAllClose(raw['image/object/bbox/ymax'].float_list.value, [0.9, 1.0])

        parsed = tfrecord.parse_example(records[0])
        self.assertEqual(parsed['encoded'].numpy(), encoded)
        self.assertEqual(int(parsed['label']), 417)
        # tf.image order: ymin, xmin, ymax, xmax.
        self.assertAllClose(parsed['boxes'], [[0.2, 0.1, 0.9, 0.5], [0.0, 0.0, 1.0, 1.0]])
        self.assertAllEqual(tf.io.decode_jpeg(parsed['encoded']), tf.io.decode_jpeg(encoded))
        self.assertEqual(tfrecord.read_labels(path), [417, 417])

    def test_record_without_boxes_parses_to_empty_boxes(self):
        example = tfrecord.make_example(b'x', 1, 1, 1)
        self.assertEqual(tfrecord.parse_example(example.SerializeToString())['boxes'].shape, (0, 4))

    def test_label_convention_imagenet_1_to_1000(self):
        disk = tf.constant([1, 2, 1000])
        self.assertAllEqual(tfrecord.to_model_label(disk, label_offset=1, num_classes=1000), [0, 1, 999])
        # The 1001-class convention keeps the on-disk numbers (class 0 = background, never seen).
        self.assertAllEqual(tfrecord.to_model_label(disk, label_offset=0, num_classes=1001), [1, 2, 1000])

    def test_label_outside_range_fails(self):
        for label in (0, 1001):
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'label out of range'):
                tfrecord.to_model_label(tf.constant([label]), label_offset=1, num_classes=1000)

    def test_shard_names_follow_imagenet_to_gcs(self):
        self.assertEqual(tfrecord.shard_name('train', 7, 1024), 'train-00007-of-01024')
        self.assertEqual(tfrecord.shard_name('validation', 127, 128), 'validation-00127-of-00128')


if __name__ == '__main__':
    tf.test.main()
