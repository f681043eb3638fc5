"""The evaluation command: a run's checkpoints evaluated again give the run's own held-out figures, every
image once, per-class accuracy named from labels.txt, a plot over checkpoints, and one-line errors."""

import contextlib
import csv
import dataclasses
import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from unittest import mock

from absl import flags
from absl import logging as absl_logging
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu import errors
from imagenet_tpu import evaluate
from imagenet_tpu.commands import evaluate as evaluate_command
from imagenet_tpu.data import labels
from imagenet_tpu import train

helpers.use_eight_cpus()


class EvaluateTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='evaluate-', dir=tf.compat.v1.test.get_temp_dir())
        cls.data_dir = os.path.join(cls.root, 'data')
        written = helpers.write_dataset(cls.data_dir, num_classes=4)
        cls.validation_labels = written['validation'][1] - 1          # model classes of the 20 held-out images
        labels.write(labels.path_in(cls.data_dir), [labels.Label(c + 1, f'n{c}', name)
                                                    for c, name in enumerate(['ant', 'bee', 'cat', 'dog'])])
        cls.model_dir = os.path.join(cls.root, 'run')
        config = helpers.tiny_config(data_dir=cls.data_dir, model_dir=cls.model_dir, norm='batch_norm',
                                     num_classes=4, checkpoint_every_steps=2, log_every_steps=0, seed=3)
        cls.trained = train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)

    def test_the_latest_checkpoint_gives_the_runs_own_figures_and_every_class(self):
        config = evaluate.run_config(self.model_dir)
        lines = []
        (result,) = evaluate.evaluate_run(config, 'latest', helpers.mirrored(2), print_fn=lines.append)
        self.assertEqual(result['checkpoint'], 'ckpt-3')
        self.assertEqual(result['images'], 20)
        self.assertAlmostEqual(result['top_1'], self.trained['top_1'], places=6)
        self.assertAlmostEqual(result['top_5'], self.trained['top_5'], places=6)
        self.assertAllClose(result['loss'], self.trained['loss'], rtol=1e-5)
        with open(os.path.join(self.model_dir, 'eval', 'ckpt-3_per_class.csv')) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([row['name'] for row in rows], ['ant', 'bee', 'cat', 'dog'])
        self.assertEqual([int(row['images']) for row in rows],
                         np.bincount(self.validation_labels, minlength=4).tolist())
        correct = sum(float(row['top_1']) * int(row['images']) for row in rows)
        self.assertAllClose(correct / 20, result['top_1'], atol=1e-6)
        with open(os.path.join(self.model_dir, 'eval', 'ckpt-3.json')) as f:
            self.assertEqual(json.load(f)['images'], 20)
        self.assertRegex(lines[0],
                         r'^ckpt-3 \(step 3\): top-1 \d+\.\d\d% top-5 \d+\.\d\d% loss \d\.\d{4} on 20 images$')

    @pytest.mark.faults
    def test_the_figures_come_before_a_write_that_fails_and_nothing_partial_stays(self):
        config = evaluate.run_config(self.model_dir)
        lines = []
        failing = mock.Mock(side_effect=OSError(errno.ENOSPC, 'No space left on device'))
        with mock.patch.object(tf.io.gfile, 'rename', failing):
            with self.assertRaisesRegex(errors.OutputError, r'cannot write .*eval/ckpt-3\.json \(No space left on '
                                                           r'device\)'):
                evaluate.evaluate_run(config, 'latest', helpers.mirrored(2), print_fn=lines.append)
        self.assertRegex(lines[0], r'^ckpt-3 \(step 3\): top-1 ')      # printed before the write
        self.assertEqual([name for name in os.listdir(os.path.join(self.model_dir, 'eval')) if '.tmp-' in name], [])

    @pytest.mark.faults
    def test_links_in_the_eval_folder_are_replaced_not_written_through(self):
        config = evaluate.run_config(self.model_dir)
        outside = tempfile.mkdtemp(dir=self.get_temp_dir())
        target = os.path.join(outside, 'precious.json')
        with open(target, 'w') as f:
            f.write('keep me')
        eval_dir = os.path.join(self.model_dir, 'eval')
        shutil.rmtree(eval_dir, ignore_errors=True)
        os.makedirs(eval_dir)
        os.symlink(target, os.path.join(eval_dir, 'ckpt-3.json'))
        evaluate.evaluate_run(config, 'latest', helpers.mirrored(2), print_fn=lambda line: None)
        with open(target) as f:
            self.assertEqual(f.read(), 'keep me')
        self.assertFalse(os.path.islink(os.path.join(eval_dir, 'ckpt-3.json')))
        # the folder itself a link elsewhere: removed (not its target) and made a folder of the run
        shutil.rmtree(eval_dir)
        os.symlink(outside, eval_dir)
        evaluate.evaluate_run(config, 'latest', helpers.mirrored(2), print_fn=lambda line: None)
        self.assertEqual(os.listdir(outside), ['precious.json'])
        self.assertFalse(os.path.islink(eval_dir))
        self.assertTrue(os.path.exists(os.path.join(eval_dir, 'ckpt-3.json')))

    def test_all_checkpoints_and_a_plot(self):
        results = evaluate.evaluate_run(evaluate.run_config(self.model_dir), 'all', helpers.mirrored(2),
                                        print_fn=lambda line: None)
        self.assertEqual([result['step'] for result in results], [2, 3])
        self.assertNotEqual(results[0]['loss'], results[1]['loss'])
        with open(os.path.join(self.model_dir, 'eval', 'accuracy.png'), 'rb') as f:
            self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')

    def test_bad_input_is_a_clear_error(self):
        config = evaluate.run_config(self.model_dir)
        with self.assertRaisesRegex(errors.CheckpointError, 'has no ckpt-99; it has ckpt-2, ckpt-3'):
            evaluate.evaluate_run(config, 'ckpt-99', helpers.mirrored(2))
        with self.assertRaisesRegex(errors.CheckpointError, r'different model \(depth=10 there, 18 now\)'):
            evaluate.evaluate_run(dataclasses.replace(config, depth=18), 'latest', helpers.mirrored(2))
        empty = os.path.join(self.root, 'empty')
        os.makedirs(empty, exist_ok=True)
        with self.assertRaisesRegex(errors.CheckpointError, 'has no config.json'):
            evaluate.run_config(empty)
        with self.assertRaisesRegex(errors.CheckpointError, 'no checkpoint in'):
            evaluate.select_checkpoints(empty, 'latest')
        no_validation = os.path.join(self.root, 'train_only')
        os.makedirs(no_validation, exist_ok=True)
        for name in os.listdir(self.data_dir):
            if name.startswith('train'):
                os.symlink(os.path.join(self.data_dir, name), os.path.join(no_validation, name))
        with self.assertRaisesRegex(errors.DataError, 'no validation files'):
            evaluate.evaluate_run(dataclasses.replace(config, data_dir=no_validation), 'latest', helpers.mirrored(2))

    def copy_of_the_run(self, name: str) -> str:
        copy = os.path.join(self.root, name)
        shutil.copytree(self.model_dir, copy, ignore=shutil.ignore_patterns('eval'))
        return copy

    def test_a_damaged_config_json_is_one_line_naming_the_file(self):
        with open(os.path.join(self.model_dir, 'config.json')) as f:
            text = f.read()
        settings = json.loads(text)
        cases = (
            ('random_bytes', bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)),
             'is damaged: not UTF-8 text$'),
            ('truncated', text[:len(text) // 2].encode(), r'is damaged: not valid JSON \(.*line \d+ column \d+'),
            ('a_list', json.dumps(list(settings.items())).encode(),
             'is damaged: a JSON list, not an object of settings$'),
            ('a_number', b'42', 'is damaged: a JSON int, not an object of settings$'),
            ('a_string_for_a_number', json.dumps({**settings, 'depth': 'ten'}).encode(),
             "is damaged: depth is 'ten', not a int$"),
            ('a_list_for_a_number', json.dumps({**settings, 'label_smoothing': [0.1]}).encode(),
             'is damaged: label_smoothing is \\[0.1\\], not a float$'),
            ('null_for_a_number', json.dumps({**settings, 'num_classes': None}).encode(),
             'is damaged: num_classes is None, not a int$'),
            ('a_setting_out_of_range', json.dumps({**settings, 'depth': 7}).encode(),
             'holds settings that do not load: unknown depth 7; choose one of'),
        )
        for name, content, expected in cases:
            with self.subTest(name):
                model_dir = os.path.join(self.root, f'config-{name}')
                os.makedirs(model_dir, exist_ok=True)
                with open(os.path.join(model_dir, 'config.json'), 'wb') as f:
                    f.write(content)
                with self.assertRaisesRegex(errors.CheckpointError,
                                            f'^{re.escape(os.path.join(model_dir, "config.json"))} {expected}'):
                    evaluate.run_config(model_dir)
        # A setting given on the command line that does not work is the setting's error, not the file's.
        with self.assertRaisesRegex(errors.ConfigError, '^unknown depth 7; choose one of') as raised:
            evaluate.run_config(self.model_dir, {'depth': 7})
        self.assertNotIsInstance(raised.exception, errors.CheckpointError)

    def test_a_damaged_config_json_through_the_command_is_one_error_line(self):
        model_dir = self.copy_of_the_run('command-random-bytes')
        with open(os.path.join(model_dir, 'config.json'), 'wb') as f:
            f.write(b'\x93\xfe\x00garbage')
        stderr = io.StringIO()
        levels = absl_logging.get_verbosity(), tf.get_logger().level
        with flagsaver.flagsaver(), contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exited:
            try:
                evaluate_command.main(flags.FLAGS(['imagenet-tpu-eval', f'--model_dir={model_dir}']))
            finally:
                absl_logging.set_verbosity(levels[0])
                tf.get_logger().setLevel(levels[1])
        self.assertEqual(exited.exception.code, 2)
        self.assertEqual(stderr.getvalue().splitlines(),
                         [f'error: {model_dir}/config.json is damaged: not UTF-8 text'])

    def test_a_damaged_model_json_is_one_line_naming_the_file(self):
        for name, content, expected in (('random_bytes', b'\xff\xd8\x00\x10garbage', 'not UTF-8 text'),
                                        ('truncated', b'{"depth": 10, "num_cl', 'not valid JSON'),
                                        ('a_list', b'[10, 4, 16]', 'a JSON list, not an object of model settings')):
            with self.subTest(name):
                model_dir = self.copy_of_the_run(f'model-json-{name}')
                path = os.path.join(model_dir, 'model.json')
                with open(path, 'wb') as f:
                    f.write(content)
                config = evaluate.run_config(model_dir)
                with self.assertRaisesRegex(errors.CheckpointError, f'^{re.escape(path)} is damaged: {expected}'):
                    evaluate.evaluate_run(config, 'latest', print_fn=lambda line: None)

    def test_a_damaged_checkpoint_state_file_is_no_traceback(self):
        # TensorFlow's state file is only a hint (checkpoints.checkpoint_paths lists the checkpoints' own files),
        # and the evaluator makes no CheckpointManager, which would parse it: the latest checkpoint is evaluated.
        # (Where the state file is what lists the checkpoints, the error is one line naming the folder.)
        for name, content in (('random_bytes', bytes(np.random.default_rng(1).integers(0, 256, 200, np.uint8))),
                              ('empty', b'')):
            with self.subTest(name):
                model_dir = self.copy_of_the_run(f'state-{name}')
                with open(os.path.join(model_dir, 'checkpoints', 'checkpoint'), 'wb') as f:
                    f.write(content)
                try:
                    (result,) = evaluate.evaluate_run(evaluate.run_config(model_dir), 'latest', helpers.mirrored(2),
                                                      print_fn=lambda line: None)
                except errors.CheckpointError as error:
                    self.assertRegex(str(error), f'^(cannot list the checkpoints|no checkpoint) in '
                                                 f'{re.escape(os.path.join(model_dir, "checkpoints"))}')
                    self.assertNotIn('\n', str(error))
                else:
                    self.assertEqual(result['checkpoint'], 'ckpt-3')
                    self.assertAlmostEqual(result['top_1'], self.trained['top_1'], places=6)

    def test_one_line_error_in_a_real_process(self):
        process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.evaluate', f'--model_dir={self.model_dir}',
                                  '--checkpoint=ckpt-99', '--num_cpu_devices=2'], cwd=helpers.REPO,
                                 env=helpers.subprocess_environment(), capture_output=True, text=True, timeout=300)
        self.assertEqual(process.returncode, 2, process.stderr)
        self.assertEqual(process.stderr.strip().splitlines(),
                         [f'error: {self.model_dir}/checkpoints has no ckpt-99; it has ckpt-2, ckpt-3'])


if __name__ == '__main__':
    tf.test.main()


@pytest.mark.faults
class BatchFiguresTest(tf.test.TestCase):
    """The evaluation command's per-image figures against Keras's loss and TensorFlow's in_top_k, and at a class
    count whose one-hot targets would not fit in memory."""

    def test_against_keras_and_in_top_k(self):
        rng = np.random.default_rng(4)
        logits = rng.normal(size=(32, 50)).astype(np.float32)
        labels = rng.integers(0, 50, size=32)
        losses, top_1, top_5 = evaluate.batch_figures(logits, labels, 0.1)
        reference = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1, reduction="none")(
            tf.one_hot(labels, 50), logits)
        self.assertAllClose(losses, reference, atol=1e-5)
        self.assertAllEqual(top_1, tf.math.in_top_k(labels, logits, 1))
        self.assertAllEqual(top_5, tf.math.in_top_k(labels, logits, 5))

    def test_a_hundred_thousand_classes_in_little_memory(self):
        logits = np.random.default_rng(5).normal(size=(64, 100_000)).astype(np.float32)
        labels = np.arange(64) * 1000
        tracemalloc.start()
        losses, _, _ = evaluate.batch_figures(logits, labels, 0.1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        self.assertLess(peak, 10 * logits.nbytes)     # one-hot targets alone: 2 x 64 x 100,000 x 8 bytes more
        self.assertTrue(np.all(np.isfinite(losses)))


class EvaluationConfigTest(tf.test.TestCase):
    """A pod's batch-norm groups on a smaller machine (found by rehearsing the 64k recipe: its export failed)."""

    def test_groups_that_do_not_fit_are_evaluated_per_replica_unless_last_batch(self):
        grouped = helpers.tiny_config(norm='batch_norm', bn_group_size=8, global_batch_size=64)
        self.assertEqual(evaluate.evaluation_config(grouped, 2).bn_group_size_for(2), 1)
        self.assertEqual(evaluate.evaluation_config(grouped, 8), grouped)       # they fit: kept
        last_batch = dataclasses.replace(grouped, bn_inference_statistics='last_batch')
        self.assertEqual(evaluate.evaluation_config(last_batch, 2), last_batch)  # the groups' statistics matter
