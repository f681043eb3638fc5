"""TensorFlow Lite and ONNX: a network trained on the demo digits, exported by imagenet-tpu-export, run by TensorFlow
Lite's interpreter and by onnxruntime directly (not through this package) on real JPEGs: the float models give the
SavedModel's logits, the int8 model loses at most a stated number of points of top-1, and export.json reports
what the files score on the validation shards."""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu import builders, deploy
from imagenet_tpu import evaluate
from imagenet_tpu import train
from imagenet_tpu.data import preprocessing
from imagenet_tpu.data import record_io
from imagenet_tpu.data import tfrecord
from imagenet_tpu.serving import convert

onnxruntime = pytest.importorskip('onnxruntime')
pytest.importorskip('tf2onnx')

helpers.use_eight_cpus()

IMAGE_SIZE = 16
# The stated bounds. Float logits: float32 rounding of the same operations in another order (measured at most
# 2e-6 relative to the largest logit); int8: measured 0.3 points below the float top-1 on the 359 held-out digits.
FLOAT_TOLERANCE = 1e-4
INT8_MAX_LOSS_POINTS = 2.0


def write_demo(data_dir: str) -> None:
    """The demo digits (tools/data/make_demo_data.py) at IMAGE_SIZE: 1,438 training and 359 held-out images."""
    process = subprocess.run([sys.executable, os.path.join(helpers.REPO, 'tools', 'data', 'make_demo_data.py'),
                              f'--output_dir={data_dir}', f'--image_size={IMAGE_SIZE}', '--train_shards=4'],
                             capture_output=True, text=True, env=helpers.subprocess_environment(), timeout=300)
    assert process.returncode == 0, process.stderr[-2000:]


@pytest.mark.slow
class ConvertTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='convert-', dir=tf.compat.v1.test.get_temp_dir())
        cls.data_dir = os.path.join(cls.root, 'digits')
        write_demo(cls.data_dir)
        cls.model_dir = os.path.join(cls.root, 'run')
        config = helpers.tiny_config(data_dir=cls.data_dir, model_dir=cls.model_dir, norm='batch_norm', num_classes=10,
                                     image_size=IMAGE_SIZE, num_train_images=1438, num_eval_images=359,
                                     global_batch_size=64, eval_batch_size=64, train_epochs=3, base_learning_rate=0.2,
                                     warmup_epochs=0.5, label_offset=1, log_every_steps=0, seed=1,
                                     random_crop_min_area=0.5, shuffle_buffer=512)
        cls.trained = train.train_and_evaluate(config, helpers.mirrored(1), print_fn=lambda line: None)
        cls.lines = []
        cls.exported = deploy.export_run(evaluate.run_config(cls.model_dir), representative_images=128,
                                         strategy=helpers.mirrored(1), print_fn=cls.lines.append)
        print('\n'.join(cls.lines))
        cls.export_dir = os.path.join(cls.model_dir, 'export', cls.exported['checkpoint'])
        # Real JPEGs: the first 64 held-out digits as the evaluation preprocesses them.
        encoded = [tfrecord.parse_example(record)['encoded']
                   for record in tf.data.TFRecordDataset(record_io.list_shards(cls.data_dir, tfrecord.VALIDATION))
                   .take(64)]
        cls.pixels = np.stack([preprocessing.preprocess_for_eval(jpeg, IMAGE_SIZE).numpy() for jpeg in encoded])
        served = tf.saved_model.load(os.path.join(cls.export_dir, 'saved_model')).signatures['serving_default']
        cls.saved_logits = served(images=tf.stack(encoded))['logits'].numpy()

    def tflite_logits(self, name: str) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            interpreter = tf.lite.Interpreter(model_path=os.path.join(self.export_dir, name))
        index = interpreter.get_input_details()[0]['index']
        interpreter.resize_tensor_input(index, list(self.pixels.shape))
        interpreter.allocate_tensors()
        interpreter.set_tensor(index, self.pixels)
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]['index'])

    def test_the_run_learned_the_digits(self):
        # Otherwise nothing below would be worth comparing.
        self.assertGreater(self.trained['top_1'], 0.5)      # chance: 0.1
        self.assertGreater(np.ptp(self.saved_logits), 5.0)

    def test_float_tflite_and_onnx_give_the_saved_models_logits_on_real_jpegs(self):
        scale = np.abs(self.saved_logits).max()
        tflite = self.tflite_logits('model.tflite')
        session = onnxruntime.InferenceSession(os.path.join(self.export_dir, 'model.onnx'),
                                               providers=['CPUExecutionProvider'])
        onnx = session.run(None, {session.get_inputs()[0].name: self.pixels})[0]
        for name, logits in (('tflite', tflite), ('onnx', onnx)):
            self.assertEqual(logits.shape, self.saved_logits.shape)
            error = np.abs(logits - self.saved_logits).max() / scale
            print(f'{name}: largest logit difference {error:.2e} of the largest logit ({scale:.1f})')
            self.assertLess(error, FLOAT_TOLERANCE, name)
            self.assertAllEqual(logits.argmax(1), self.saved_logits.argmax(1))

    def test_int8_is_a_quarter_of_the_size_and_loses_at_most_the_stated_points(self):
        files = self.exported['files']
        self.assertLess(files['tflite_int8']['mib'], 0.3 * files['tflite']['mib'])
        interpreter_tensors = self.tflite_logits('model_int8.tflite')
        self.assertEqual(interpreter_tensors.shape, self.saved_logits.shape)
        evaluation = self.exported['evaluation']
        for kind in ('saved_model', 'tflite', 'tflite_int8', 'onnx'):
            self.assertEqual(evaluation[kind]['images'], 359, kind)
        # The SavedModel's top-1 is the run's own held-out top-1; the float formats agree with it to an image.
        self.assertAlmostEqual(evaluation['saved_model']['top_1'], self.trained['top_1'], places=6)
        for kind in ('tflite', 'onnx'):
            self.assertLessEqual(abs(evaluation[kind]['top_1'] - evaluation['saved_model']['top_1']), 1 / 359, kind)
        loss = 100 * (evaluation['tflite']['top_1'] - evaluation['tflite_int8']['top_1'])
        print(f"top-1: SavedModel {100 * evaluation['saved_model']['top_1']:.2f}%, int8 loses {loss:.2f} points")
        self.assertLessEqual(loss, INT8_MAX_LOSS_POINTS)
        with open(os.path.join(self.export_dir, 'export.json')) as f:
            self.assertEqual(json.load(f)['evaluation']['tflite_int8']['top_1'], evaluation['tflite_int8']['top_1'])
        self.assertTrue(any(line.startswith('tflite_int8: top-1 ') and 'points' in line for line in self.lines))


class ExportCommandTest(tf.test.TestCase):

    def test_bad_settings_are_one_line_errors(self):
        for arguments, message in ((['--model_dir=run', '--formats=tflite,coreml'], 'unknown coreml'),):
            process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.export', *arguments],
                                     capture_output=True, text=True, env=helpers.subprocess_environment(), timeout=120)
            self.assertEqual(process.returncode, 2, process.stderr)
            self.assertEqual(process.stderr.strip().splitlines()[-1][:7], 'error: ')
            self.assertIn(message, process.stderr)
            self.assertNotIn('Traceback', process.stderr)


class BfloatExportTest(tf.test.TestCase):
    """A run trained in mixed_bfloat16 (every TPU recipe) exports a float32 twin: TensorFlow Lite and ONNX
    convert it, and all formats compute the trained network's function."""

    def test_a_bfloat16_network_exports_to_every_format(self):
        config = helpers.tiny_config(norm='batch_norm', num_classes=4, image_size=IMAGE_SIZE,
                                     precision='mixed_bfloat16')
        keras.utils.set_random_seed(3)
        network = builders.build_network(config)
        self.assertEqual(network.get_layer('stem_conv').compute_dtype, 'bfloat16')
        twin = builders.build_export_network(config, network)
        self.assertEqual({layer.compute_dtype for layer in twin.layers} - {None}, {'float32'})
        pixels = np.random.default_rng(0).uniform(0, 255, [4, IMAGE_SIZE, IMAGE_SIZE, 3]).astype(np.float32)
        reference = twin(pixels, training=False).numpy()
        trained = network(tf.cast(pixels, tf.bfloat16), training=False).numpy()
        # The same function: bfloat16 keeps 8 bits of mantissa, so the two differ by its rounding only.
        self.assertAllClose(trained, reference, atol=0.05 * np.abs(reference).max() + 1e-3)
        function = convert.logits_function(twin, IMAGE_SIZE)
        root = tempfile.mkdtemp(dir=tf.compat.v1.test.get_temp_dir())
        for kind in convert.FORMATS:
            path = os.path.join(root, convert.FILE_NAMES[kind])
            if kind == 'onnx':
                convert.to_onnx(function, path)
            else:
                representative = (lambda: ([pixels[i:i + 1]] for i in range(4))) if kind == 'tflite_int8' else None
                with open(path, 'wb') as f:
                    f.write(convert.to_tflite(function, twin, representative))
            logits = convert.load(kind, path)(pixels)
            tolerance = 0.2 if kind == 'tflite_int8' else 1e-4
            self.assertAllClose(logits, reference, atol=tolerance * np.abs(reference).max() + 1e-4, msg=kind)
