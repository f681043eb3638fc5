"""The SavedModel: encoded images in, probabilities and named top-5 classes out, with exactly the evaluation
preprocessing of training; it loads and runs in a fresh process without this package, and saved_model_cli works."""

import io
import os
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.serving import export
from imagenet_tpu.data import preprocessing
from imagenet_tpu import builders

NAMES = ['cat', 'dog', 'fish', 'bird']


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


class ExportTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='export-', dir=tf.compat.v1.test.get_temp_dir())
        cls.config = helpers.tiny_config(norm='batch_norm', num_classes=4, image_size=32, eval_crop_fraction=0.8,
                                         resize_method='bicubic')
        keras.utils.set_random_seed(1)
        cls.network = builders.build_network(cls.config)
        cls.path = os.path.join(cls.root, 'saved_model')
        export.export_saved_model(cls.network, cls.path, NAMES, **builders.export_settings(cls.config))
        cls.pixels = helpers.photo_like(40, 52, seed=5)
        cls.jpeg = tf.io.encode_jpeg(cls.pixels, quality=90).numpy()
        buffer = io.BytesIO()
        Image.fromarray(cls.pixels).save(buffer, format='PNG')
        cls.png = buffer.getvalue()
        cls.jpeg_path = os.path.join(cls.root, 'photo.jpg')
        with open(cls.jpeg_path, 'wb') as f:
            f.write(cls.jpeg)

    def reference(self, images: np.ndarray) -> np.ndarray:
        return softmax(self.network(images, training=False).numpy().astype(np.float64))

    def test_encoded_images_get_the_evaluation_preprocessing(self):
        served = tf.saved_model.load(self.path).signatures['serving_default']
        outputs = served(images=tf.constant([self.jpeg, self.png]))
        # JPEG: the evaluation pipeline's own function. PNG: decoded by PIL, the centre 0.8 of the shorter side cut
        # with NumPy, resized with TensorFlow's bicubic filter.
        jpeg_pixels = preprocessing.preprocess_for_eval(tf.constant(self.jpeg), 32, crop_fraction=0.8,
                                                        resize_method='bicubic')
        side = int(0.8 * 40)
        top, left = (40 - side + 1) // 2, (52 - side + 1) // 2
        crop = np.asarray(Image.open(io.BytesIO(self.png)))[top:top + side, left:left + side].astype(np.float32)
        png_pixels = tf.image.resize(crop, [32, 32], method='bicubic')
        expected = self.reference(np.stack([jpeg_pixels.numpy(), png_pixels.numpy()]))
        self.assertAllClose(outputs['probabilities'], expected, atol=1e-5)
        order = np.argsort(-expected, axis=1)[:, :4]
        self.assertAllEqual(outputs['classes'], order)
        self.assertAllEqual(outputs['names'].numpy().astype(str), np.array(NAMES)[order])
        self.assertAllClose(outputs['scores'], np.take_along_axis(expected, order, 1), atol=1e-5)

    def test_pixels_signature(self):
        pixels = helpers.photo_like(32, 32, seed=9)[np.newaxis]
        outputs = tf.saved_model.load(self.path).signatures['serving_pixels'](pixels=tf.constant(pixels))
        self.assertAllClose(outputs['probabilities'], self.reference(pixels.astype(np.float32)), atol=1e-5)

    @pytest.mark.slow
    def test_loads_and_runs_in_a_fresh_process_without_this_package(self):
        result = os.path.join(self.root, 'probabilities.npy')
        script = ('import sys\nsys.modules["imagenet_tpu"] = None   # any import of the package fails\n'
                  'import numpy as np\nimport tensorflow as tf\n'
                  f'served = tf.saved_model.load({self.path!r}).signatures["serving_default"]\n'
                  f'outputs = served(images=tf.constant([open({self.jpeg_path!r}, "rb").read()]))\n'
                  f'np.save({result!r}, outputs["probabilities"].numpy())\n'
                  'print(outputs["names"].numpy()[0][0].decode())\n')
        environment = {key: value for key, value in helpers.subprocess_environment().items() if key != 'PYTHONPATH'}
        process = subprocess.run([sys.executable, '-c', script], cwd=self.root, env=environment,
                                 capture_output=True, text=True, timeout=300)
        self.assertEqual(process.returncode, 0, process.stderr[-3000:])
        served = tf.saved_model.load(self.path).signatures['serving_default']
        expected = served(images=tf.constant([self.jpeg]))
        self.assertAllClose(np.load(result), expected['probabilities'], atol=1e-6)
        self.assertEqual(process.stdout.strip(), expected['names'].numpy()[0][0].decode())

    @pytest.mark.slow
    def test_saved_model_cli_shows_and_runs_it(self):
        cli = os.path.join(os.path.dirname(sys.executable), 'saved_model_cli')
        shown = subprocess.run([cli, 'show', '--dir', self.path, '--all'], capture_output=True, text=True,
                               timeout=300, env=helpers.subprocess_environment())
        self.assertEqual(shown.returncode, 0, shown.stderr[-3000:])
        self.assertRegex(shown.stdout, r"signature_def\['serving_default'\]:(.|\n)*dtype: DT_STRING")
        batch = os.path.join(self.root, 'pixels.npy')
        np.save(batch, helpers.photo_like(32, 32, seed=9)[np.newaxis])
        ran = subprocess.run([cli, 'run', '--dir', self.path, '--tag_set', 'serve', '--signature_def',
                              'serving_pixels', '--inputs', f'pixels={batch}'], capture_output=True, text=True,
                             timeout=300, env=helpers.subprocess_environment())
        self.assertEqual(ran.returncode, 0, ran.stderr[-3000:])
        self.assertIn('probabilities', ran.stdout)


if __name__ == '__main__':
    tf.test.main()
