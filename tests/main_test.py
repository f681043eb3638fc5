"""The command line: each bad input ends with one clear line and a non-zero exit, never a traceback."""

import contextlib
import glob
import io
import json
import os
import subprocess
import sys

from absl import flags
from absl import logging as absl_logging
from absl.testing import flagsaver, parameterized
import pytest
import tensorflow as tf

import bad_records_test
import helpers
from imagenet_tpu import main, schedules, train

helpers.use_eight_cpus()

REPO = helpers.REPO
SMALL = ['--depth=10', '--image_size=16', '--num_classes=4', '--num_train_images=48', '--num_eval_images=20',
         '--global_batch_size=16', '--eval_batch_size=16', '--train_epochs=1', '--strategy=cpu']


def run_main(*args):
    """The command in a real process: (exit status, stderr)."""
    process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.main', *args], cwd=REPO,
                             env=helpers.subprocess_environment(),
                             capture_output=True, text=True, timeout=300)
    return process.returncode, process.stderr


def run_main_in_process(*args):
    """main.main on ``args`` in this process, flags restored after: (exit status, stderr). The real process
    (run_main) adds only absl's app.run around it, which test_one_line_error_in_a_real_process covers."""
    # Settings main() makes for the whole process, which this one must not take on (or cannot: other devices).
    assert not any(arg.startswith(('--seed', '--deterministic', '--num_cpu_devices')) for arg in args), args
    stderr = io.StringIO()
    levels = absl_logging.get_verbosity(), tf.get_logger().level
    with flagsaver.flagsaver(), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            main.main(flags.FLAGS(['imagenet-tpu-train', *args]))
            status = 0
        except SystemExit as exit_:
            status = exit_.code
        finally:
            absl_logging.set_verbosity(levels[0])
            tf.get_logger().setLevel(levels[1])
    return status, stderr.getvalue()


class MainTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = helpers.class_folder(cls)
        cls.data_dir = os.path.join(cls.root, 'data')
        cls.empty_dir = os.path.join(cls.root, 'empty')
        os.makedirs(cls.empty_dir, exist_ok=True)
        cls.train_only_dir = os.path.join(cls.root, 'train_only')
        helpers.write_dataset(cls.train_only_dir, validation_shards=1)
        for name in os.listdir(cls.train_only_dir):
            if name.startswith('validation'):
                os.remove(os.path.join(cls.train_only_dir, name))
        cls.truncated_dir = os.path.join(cls.root, 'truncated')
        helpers.write_dataset(cls.truncated_dir)
        shard = os.path.join(cls.truncated_dir, 'train-00002-of-00004')
        with open(shard, 'rb') as f:
            content = f.read()
        with open(shard, 'wb') as f:
            f.write(content[:len(content) // 2])
        cls.unreadable_dir = os.path.join(cls.root, 'unreadable')
        helpers.write_dataset(cls.unreadable_dir)
        # A dangling link: listed by the glob, but it cannot be opened (chmod does not stop root).
        os.remove(os.path.join(cls.unreadable_dir, 'train-00001-of-00004'))
        os.symlink(os.path.join(cls.root, 'gone'), os.path.join(cls.unreadable_dir, 'train-00001-of-00004'))
        cls.a_file = os.path.join(cls.root, 'a_file')
        open(cls.a_file, 'w').close()
        cls.flagfile = os.path.join(cls.root, 'bad.cfg')
        with open(cls.flagfile, 'w') as f:
            f.write('--depth=10\n--bogus_setting=3\n')

    def assert_one_line_error(self, args, expected, status=2, prefix='error: ', run=run_main_in_process):
        code, stderr = run(*args)
        self.assertEqual(code, status, stderr)
        self.assertNotIn('Traceback', stderr)
        lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
        self.assertLen(lines, 1, stderr)
        self.assertRegex(lines[0], expected)

    @parameterized.named_parameters(
        ('missing_data_dir', lambda c: ['--data_dir=' + os.path.join(c.root, 'nowhere')], 'does not exist'),
        ('empty_data_dir', lambda c: ['--data_dir=' + c.empty_dir], r'no train files matching train-\*-of-\*'),
        ('no_validation_files', lambda c: ['--data_dir=' + c.train_only_dir], 'no validation files matching'),
        ('no_data_dir', lambda c: [], '--data_dir is not set'),
        ('batch_not_divisible', lambda c: ['--data_dir=' + c.data_dir, '--global_batch_size=12'],
         'global_batch_size=12 is not divisible by the 8 replicas'),
        ('unknown_strategy', lambda c: ['--data_dir=' + c.data_dir, '--strategy=abacus'],
         "unknown strategy 'abacus'"),
        ('model_dir_not_writable', lambda c: ['--data_dir=' + c.data_dir, '--model_dir=' + c.a_file + '/run'],
         'is not writable'),
        ('label_outside_classes', lambda c: ['--data_dir=' + c.data_dir, '--num_classes=3', '--bad_records=fatal'],
         # Caught at start: the first records of the first 8 shards (here shard 3 holds the label 4).
         r'label 4 is outside \[1, 4\)'),
        ('truncated_tfrecord_fatal', lambda c: ['--data_dir=' + c.truncated_dir, '--bad_records=fatal'],
         'bad input record: .*(truncated|corrupted) record'),
        ('unreadable_file', lambda c: ['--data_dir=' + c.unreadable_dir], 'cannot read .*train-00001-of-00004'),
        ('bn_group_not_dividing_replicas', lambda c: ['--data_dir=' + c.data_dir, '--bn_group_size=3'],
         'batch-norm group of 3 replicas does not divide the 8 replicas'),
    )
    def test_bad_input(self, make_args, expected):
        self.assert_one_line_error(SMALL + make_args(self), expected)

    def test_one_line_error_in_a_real_process(self):
        self.assert_one_line_error(SMALL + ['--data_dir=' + self.unreadable_dir], 'cannot read .*train-00001-of-00004',
                                   run=run_main)

    @pytest.mark.slow
    def test_bad_records_are_skipped_counted_and_reported(self):
        data_dir = os.path.join(self.root, 'bad_records')
        bad_records_test.write_bad_dataset(data_dir)
        model_dir = os.path.join(self.root, 'bad_records_run')
        process = subprocess.run(
            [sys.executable, '-m', 'imagenet_tpu.main', f'--data_dir={data_dir}', f'--model_dir={model_dir}',
             '--depth=10', '--image_size=16', '--num_classes=16', '--num_train_images=16', '--num_eval_images=16',
             '--global_batch_size=8', '--eval_batch_size=8', '--train_epochs=2', '--strategy=cpu',
             '--num_cpu_devices=2'], cwd=REPO, env=helpers.subprocess_environment(), capture_output=True, text=True, timeout=300)
        self.assertEqual(process.returncode, 0, process.stderr[-3000:])
        self.assertRegex(process.stdout, r'input: skipped \d+ bad records so far .* and \d+ truncated files')
        with open(os.path.join(model_dir, 'results.json')) as f:
            results = json.load(f)
        # Evaluation alone meets 3 bad records and 1 cut file; training reads ahead of its 2 epochs.
        self.assertGreaterEqual(results['bad_records'], 3 + 3)
        self.assertGreaterEqual(results['truncated_files'], 1 + 1)
        self.assertEqual(results['eval_images'], 16)      # every good validation image, once

    def test_unknown_flag_in_flagfile(self):
        self.assert_one_line_error(['--flagfile=' + self.flagfile], "Unknown command line flag 'bogus_setting'",
                                   status=1, prefix='FATAL Flags parsing error', run=run_main)


    @parameterized.parameters(*sorted(glob.glob(os.path.join(REPO, 'flags', '*.cfg'))))
    def test_every_recipe_parses_and_builds_its_optimizer_and_schedule(self, path):
        with flagsaver.flagsaver():
            flags.FLAGS(['imagenet-tpu-train', f'--flagfile={path}'])
            config = main.config_from_flags()
        with open(path) as f:
            lines = [line.strip() for line in f if line.startswith('--global_batch_size=')]
        self.assertEqual(lines, [f'--global_batch_size={config.global_batch_size}'])
        optimizer = train.build_optimizer(config)
        self.assertEqual(type(optimizer).__name__, {'sgd': 'SGD', 'lars': 'LARS',
                                                    'rmsprop_warmup': 'RMSpropWarmup'}[config.optimizer])
        rate = train.build_learning_rate(config)
        peak = max(float(rate(step)) for step in range(0, config.train_steps + 1, max(1, config.train_steps // 200)))
        # Akiba et al.'s slow start never reaches eta itself: it starts at 0.5 eta.
        highest = schedules.SLOW_START_MULTIPLIERS[0] if config.lr_decay == 'slow_start' else 1.0
        self.assertAllClose(peak, highest * config.peak_learning_rate, rtol=0.02)
        self.assertGreater(peak, 0)


if __name__ == '__main__':
    tf.test.main()
