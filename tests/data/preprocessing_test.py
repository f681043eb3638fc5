"""Preprocessing against independent references: random crops within the configured area and aspect ranges
and honouring boxes; evaluation crops of real photographs against PIL decoding and a NumPy centre crop; images
whose header claims more pixels than MAX_IMAGE_PIXELS refused before decoding, as bad records of the pipeline."""

import dataclasses
import io
import os
import re
import struct

import numpy as np
from PIL import Image
import sklearn.datasets
import tensorflow as tf

import helpers
from imagenet_tpu.training import loop
from imagenet_tpu.data import eval_input, input_pipeline
from imagenet_tpu.data import preprocessing
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord
from imagenet_tpu.config import Config
from imagenet_tpu.errors import DataError, summarize_graph_error

helpers.use_eight_cpus()

PHOTOS = [os.path.join(os.path.dirname(sklearn.datasets.__file__), 'images', name)
          for name in ('china.jpg', 'flower.jpg')]
SAMPLES = 2000


def windows(shape, boxes, min_area=0.08):
    sample = tf.function(lambda seed: preprocessing.sample_crop_window(tf.constant(shape), boxes,
                                                                       min_area=min_area, seed=seed))
    return np.array([sample(tf.constant([i, 7], tf.int64)).numpy() for i in range(SAMPLES)])


class CropStatisticsTest(tf.test.TestCase):

    def test_area_and_aspect_ratio_stay_in_their_ranges(self):
        height, width = 375, 500
        found = windows([height, width, 3], tf.zeros([0, 4]), min_area=0.08)
        y, x, h, w = found.T
        self.assertTrue(np.all((y >= 0) & (x >= 0) & (y + h <= height) & (x + w <= width)))
        area = h * w / (height * width)
        whole = (h == height) & (w == width)
        crops = ~whole
        # Whole image only as the fallback after 10 failed attempts: rare for these ranges.
        self.assertLess(np.mean(whole), 0.05)
        # Windows are whole pixels, so the ranges hold up to one pixel of rounding.
        self.assertTrue(np.all(area[crops] >= 0.08 - 2 * (h[crops] + w[crops]) / (height * width)))
        aspect = w[crops] / h[crops]
        self.assertTrue(np.all(aspect >= 0.75 * (1 - 1 / h[crops]) - 1e-6), aspect.min())
        self.assertTrue(np.all(aspect <= 4 / 3 * (1 + 1 / w[crops]) + 1e-6), aspect.max())
        # Areas spread over the range rather than sitting at one end.
        self.assertLess(np.percentile(area[crops], 10), 0.3)
        self.assertGreater(np.percentile(area[crops], 90), 0.6)

    def test_crops_cover_at_least_a_tenth_of_a_box(self):
        height, width = 400, 600
        box = [0.6, 0.7, 0.9, 0.95]   # ymin, xmin, ymax, xmax: a small box in the lower right
        found = windows([height, width, 3], tf.constant([box]), min_area=0.08)
        y, x, h, w = found.T.astype(np.float64)
        top, left, bottom, right = box[0] * height, box[1] * width, box[2] * height, box[3] * width
        overlap = (np.clip(np.minimum(y + h, bottom) - np.maximum(y, top), 0, None)
                   * np.clip(np.minimum(x + w, right) - np.maximum(x, left), 0, None))
        covered = overlap / ((bottom - top) * (right - left))
        crops = ~((h == height) & (w == width))
        self.assertGreater(np.mean(crops), 0.9)
        self.assertTrue(np.all(covered[crops] >= 0.1 - 0.02), covered[crops].min())
        # Without the box, many crops would miss the corner: the box is what keeps them there.
        free = windows([height, width, 3], tf.zeros([0, 4]))
        fy, fx, fh, fw = free.T.astype(np.float64)
        free_overlap = (np.clip(np.minimum(fy + fh, bottom) - np.maximum(fy, top), 0, None)
                        * np.clip(np.minimum(fx + fw, right) - np.maximum(fx, left), 0, None))
        self.assertGreater(np.mean(free_overlap / ((bottom - top) * (right - left)) < 0.1), 0.2)

    def test_same_seed_same_crop_and_flip(self):
        with open(PHOTOS[0], 'rb') as f:
            encoded = tf.constant(f.read())
        seed = tf.constant([3, 4], tf.int64)
        first = preprocessing.preprocess_for_train(encoded, tf.zeros([0, 4]), 64, seed=seed)
        again = preprocessing.preprocess_for_train(encoded, tf.zeros([0, 4]), 64, seed=seed)
        other = preprocessing.preprocess_for_train(encoded, tf.zeros([0, 4]), 64, seed=seed + 1)
        self.assertAllEqual(first, again)
        self.assertGreater(float(tf.reduce_mean(tf.abs(first - other))), 3.0)


def source_windows(shape, count):
    """The sources' crop sampler, written as they call it: tensorflow/tpu models/official/resnet/
    resnet_preprocessing.py (distorted_bounding_box_crop, called with the constant box [0, 0, 1, 1],
    min_object_covered 0.1, aspect (3/4, 4/3), area (0.08, 1), 10 attempts), and MLPerf v0.7's imagenet_input.py
    (lines 105-112): TensorFlow's stateful sample_distorted_bounding_box."""
    tf.random.set_seed(11)     # with the op's seed too, the sequence does not depend on earlier random ops
    found = []
    for _ in range(count):
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            tf.constant(shape), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), min_object_covered=0.1,
            aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
            use_image_if_no_bounding_boxes=True, seed=7)
        found.append([begin[0], begin[1], size[0], size[1]])
    return np.array(found, np.float64)


class SourceSamplerTest(tf.test.TestCase):

    def test_area_aspect_and_fallback_match_the_sources_sampler(self):
        for shape in ([375, 500, 3], [500, 333, 3]):
            ours = windows(shape, tf.zeros([0, 4])).astype(np.float64)
            theirs = source_windows(shape, SAMPLES)
            summaries = []
            for found in (ours, theirs):
                _, _, h, w = found.T
                area, aspect = h * w / (shape[0] * shape[1]), w / h
                whole = np.mean((h == shape[0]) & (w == shape[1]))
                summaries.append((area, aspect, whole))
            for index, name in ((0, 'area'), (1, 'aspect')):
                grid = np.linspace(0, 1.5, 301)
                cdfs = [np.searchsorted(np.sort(summary[index]), grid, side='right') / SAMPLES for summary in summaries]
                # Two samples of 2,000 from one distribution: the largest CDF gap (Kolmogorov-Smirnov) exceeds
                # 1.95 * sqrt(2 / 2000) = 0.062 with probability 0.001.
                gap = np.max(np.abs(cdfs[0] - cdfs[1]))
                print(f'{shape} {name}: largest CDF gap {gap:.4f}')
                self.assertLess(gap, 0.062, f'{shape} {name}')
            self.assertLess(abs(summaries[0][2] - summaries[1][2]), 0.02, f'{shape} whole-image rate')


class EvalPreprocessingTest(tf.test.TestCase):

    def test_real_photographs_match_pil_decode_and_numpy_centre_crop(self):
        self._match_pil_and_numpy(Config(image_size=224), 224, 0.875)

    def test_crop_padding_convention_of_tensorflow_tpu(self):
        # tensorflow/tpu resnet_preprocessing.py: image_size / (image_size + CROP_PADDING), CROP_PADDING = 32.
        config = Config(image_size=128, eval_crop_padding=32)
        self.assertAlmostEqual(config.eval_crop, 0.8)
        self._match_pil_and_numpy(config, 128, 128 / (128 + 32))

    def _match_pil_and_numpy(self, config, size, fraction):
        for path in PHOTOS:
            with open(path, 'rb') as f:
                encoded = f.read()
            ours = preprocessing.preprocess_for_eval(tf.constant(encoded), size,
                                                     crop_fraction=config.eval_crop).numpy()
            # Reference: PIL decodes the whole photo, NumPy crops ``fraction`` of the shorter side at the centre.
            pixels = np.asarray(Image.open(path).convert('RGB'))
            height, width = pixels.shape[:2]
            side = int(fraction * min(height, width))
            top, left = (height - side + 1) // 2, (width - side + 1) // 2
            crop = pixels[top:top + side, left:left + side].astype(np.float32)
            resized = tf.image.resize(crop, [size, size], method='bilinear').numpy()
            reference = resized
            difference = np.abs(ours - reference)
            # Two JPEG decoders may differ by a grey level or two in places (about 0.01-0.03 here).
            print(f'{os.path.basename(path)}: mean difference {np.mean(difference):.4f}, '
                  f'largest {np.max(difference):.4f} grey levels')
            self.assertLess(float(np.mean(difference)), 0.04, path)
            self.assertLess(float(np.max(difference)), 0.5, path)
            # And the crop is the centre: shifting the reference by 8 pixels is much further away.
            shifted = pixels[top:top + side, left + 8:left + 8 + side].astype(np.float32)
            shifted = tf.image.resize(shifted, [size, size]).numpy()
            self.assertGreater(float(np.mean(np.abs(ours - shifted))), 1.0)


class ResizeFilterTest(tf.test.TestCase):

    def test_each_filter_matches_pils_on_float_pixels(self):
        # Upsampling, where PIL's filters and TensorFlow's (half-pixel centres; bicubic is Keys' a = -0.5 in both)
        # have the same support: no antialiasing on either side.
        rng = np.random.default_rng(0)
        encoded = tf.io.encode_jpeg(rng.integers(0, 256, size=(40, 40, 3)).astype(np.uint8), quality=100).numpy()
        decoded = np.asarray(Image.open(io.BytesIO(encoded)).convert('RGB')).astype(np.float32)
        outputs = {}
        for method, pil_filter in (('bilinear', Image.BILINEAR), ('bicubic', Image.BICUBIC)):
            ours = preprocessing.preprocess_for_eval(tf.constant(encoded), 64, crop_fraction=1.0,
                                                     resize_method=method).numpy()
            reference = np.stack([np.asarray(Image.fromarray(decoded[..., c], mode='F').resize((64, 64), pil_filter))
                                  for c in range(3)], axis=-1)
            self.assertAllClose(ours, reference, atol=1e-3, msg=method)
            outputs[method] = ours
        # The filters differ, and bicubic overshoots the 0..255 range on noise (kept, as the sources keep it).
        self.assertGreater(float(np.mean(np.abs(outputs['bicubic'] - outputs['bilinear']))), 1.0)
        self.assertLess(float(outputs['bicubic'].min()), 0.0)

    def test_the_setting_reaches_training_and_evaluation(self):
        with open(PHOTOS[1], 'rb') as f:
            encoded = tf.constant(f.read())
        seed = tf.constant([1, 2], tf.int64)
        train = {method: preprocessing.preprocess_for_train(encoded, tf.zeros([0, 4]), 64, seed=seed,
                                                            resize_method=method) for method in ('bilinear', 'bicubic')}
        self.assertGreater(float(tf.reduce_max(tf.abs(train['bicubic'] - train['bilinear']))), 1.0)
        with self.assertRaisesRegex(ValueError, 'resize method must be one of'):
            preprocessing.preprocess_for_eval(encoded, 64, resize_method='lanczos5')


def jpeg_claiming(width: int, height: int, seed: int = 0) -> bytes:
    """A real 20 x 24 JPEG whose frame header (SOF0: marker, length, precision, height, width) claims
    ``width`` x ``height``: about a kilobyte that would decode to width * height * 3 bytes."""
    data = bytearray(tf.io.encode_jpeg(helpers.photo_like(20, 24, seed)).numpy())
    start = data.index(b'\xff\xc0')
    data[start + 5:start + 9] = struct.pack('>HH', height, width)
    return bytes(data)


TOO_LARGE = 'image too large: 13000 x 13000 pixels (at most 89,478,485 are decoded)'


class ImageSizeLimitTest(tf.test.TestCase):

    def test_the_limit_is_pillows(self):
        self.assertEqual(preprocessing.MAX_IMAGE_PIXELS, Image.MAX_IMAGE_PIXELS)

    def test_a_jpeg_claiming_too_many_pixels_is_refused_before_decoding(self):
        bomb = tf.constant(jpeg_claiming(13000, 13000))
        self.assertAllEqual(tf.image.extract_jpeg_shape(bomb), [13000, 13000, 3])
        self.assertLess(len(bomb.numpy()), 2000)
        # 9,460 x 9,460 is just over the limit (89,491,600 pixels); a wide one too (60,000 x 1,500).
        for encoded in (bomb, tf.constant(jpeg_claiming(9460, 9460)), tf.constant(jpeg_claiming(60000, 1500))):
            for name, preprocess in (
                    ('train', lambda e: preprocessing.preprocess_for_train(e, tf.zeros([0, 4]), 16)),
                    ('eval', lambda e: preprocessing.preprocess_for_eval(e, 16)),
                    ('any', lambda e: preprocessing.preprocess_any_for_eval(e, 16)),
                    ('full', preprocessing.decode_jpeg)):
                for run in (preprocess, tf.function(preprocess)):      # eagerly, and in a graph as tf.data runs it
                    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'image too large: ', msg=name):
                        run(encoded)
        # In a graph (as in the input pipeline), the error's summary is the line.
        with self.assertRaises(tf.errors.InvalidArgumentError) as raised:
            tf.function(lambda e: preprocessing.preprocess_for_eval(e, 16))(bomb)
        self.assertEqual(summarize_graph_error(raised.exception.message), TOO_LARGE)
        # Legitimate images pass: the largest allowed square (9,459 x 9,459) is only a header here, so its shape.
        self.assertAllEqual(preprocessing.jpeg_shape(tf.constant(jpeg_claiming(9459, 9459))), [9459, 9459, 3])
        self.assertEqual(preprocessing.preprocess_for_eval(tf.constant(jpeg_claiming(24, 20)), 16).shape, [16, 16, 3])

    def test_png_and_webp_headers_are_read_and_checked_before_decoding(self):
        pixels = helpers.photo_like(36, 44, seed=3)
        for kind, options in (('PNG', {}), ('WEBP', {}), ('WEBP', {'lossless': True}),
                              ('WEBP', {'exif': b'Exif\0\0' + bytes(8)}), ('GIF', {}), ('BMP', {})):
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, kind, **options)
            encoded = tf.constant(buffer.getvalue())
            expected = [0, 0] if kind in ('GIF', 'BMP') else [36, 44]    # WebP: lossy, lossless and extended
            self.assertAllEqual(preprocessing.header_shape(encoded), expected, msg=f'{kind} {options}')
            self.assertEqual(preprocessing.preprocess_any_for_eval(encoded, 16).shape, [16, 16, 3])
        self.assertAllEqual(preprocessing.header_shape(tf.constant(b'\x89PNG')), [0, 0])     # short: nothing read
        png = bytearray(tf.io.encode_png(pixels).numpy())
        png[16:24] = struct.pack('>II', 13000, 13000)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'image too large: 13000 x 13000 pixels'):
            tf.function(lambda e: preprocessing.preprocess_any_for_eval(e, 16))(tf.constant(bytes(png)))


class BombRecordTest(tf.test.TestCase):
    """A record whose JPEG claims 13,000 x 13,000 pixels in the input pipeline: a bad record, skipped and
    counted under bad_records='skip', an error naming it under 'fatal'."""

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'bombs')
        os.makedirs(self.data_dir, exist_ok=True)
        good = [tfrecord.make_example(tf.io.encode_jpeg(helpers.photo_like(20, 24, i)).numpy(), i + 1, 20, 24)
                for i in range(8)]
        bomb = tfrecord.make_example(jpeg_claiming(13000, 13000), 1, 13000, 13000)
        for split in (tfrecord.TRAIN, tfrecord.VALIDATION):
            tfrecord.write_shard(os.path.join(self.data_dir, tfrecord.shard_name(split, 0, 1)),
                                 good[:3] + [bomb] + good[3:])
        self.config = Config(data_dir=self.data_dir, num_classes=8, label_offset=1, image_size=16,
                             global_batch_size=4, eval_batch_size=4, num_train_images=8, num_eval_images=8,
                             shuffle_buffer=16, seed=3, deterministic=True)

    def test_skipped_and_counted(self):
        counts = record_io.SkipCounts()
        batches = list(eval_input.eval_dataset(self.config, skip_counts=counts))
        labels = np.concatenate([batch[1].numpy() for batch in batches])
        weights = np.concatenate([batch[2].numpy() for batch in batches])
        self.assertCountEqual(labels[weights == 1] + 1, range(1, 9))     # every legitimate image, once
        self.assertEqual(counts.totals(), {'bad_records': 1, 'truncated_files': 0})
        counts = record_io.SkipCounts()
        labels = [labels.numpy() for _, labels in input_pipeline.train_dataset(self.config, skip_counts=counts)
                  .take(3)]
        self.assertCountEqual(np.concatenate(labels[:2]) + 1, range(1, 9))   # one epoch: the 8 legitimate images
        self.assertBetween(counts.totals()['bad_records'], 1, 2)             # this epoch's, maybe the next one's

    def test_an_error_under_bad_records_fatal(self):
        config = dataclasses.replace(self.config, bad_records='fatal')
        for dataset in (eval_input.eval_dataset(config), input_pipeline.train_dataset(config).take(4)):
            with self.assertRaisesRegex(DataError, f'^bad input record: {re.escape(TOO_LARGE)}$'):
                with loop.input_errors():
                    for _ in dataset:
                        pass


if __name__ == '__main__':
    tf.test.main()
