"""The evaluation command: a run's checkpoints evaluated again give the run's own held-out figures, every
image once, per-class accuracy named from labels.txt, a plot over checkpoints, and one-line errors."""

import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

import helpers
from imagenet_tpu import errors
from imagenet_tpu import evaluate
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

    def test_one_line_error_in_a_real_process(self):
        process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.evaluate', f'--model_dir={self.model_dir}',
                                  '--checkpoint=ckpt-99', '--num_cpu_devices=2'], cwd=helpers.REPO,
                                 env=helpers.subprocess_environment(), capture_output=True, text=True, timeout=300)
        self.assertEqual(process.returncode, 2, process.stderr)
        self.assertEqual(process.stderr.strip().splitlines(),
                         [f'error: {self.model_dir}/checkpoints has no ckpt-99; it has ckpt-2, ckpt-3'])


if __name__ == '__main__':
    tf.test.main()
