"""The command line: each bad input ends with one clear line and a non-zero exit, never a traceback."""

import contextlib
import dataclasses
import functools
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

import helpers
from imagenet_tpu.distribute import cluster
from imagenet_tpu import config as config_lib
from imagenet_tpu.commands import train as main
from imagenet_tpu.config import Config

helpers.use_eight_cpus()

REPO = helpers.REPO
SMALL = helpers.small_run_flags(train_epochs=1, strategy='cpu')

def run_main(*args, environment=None):
    """The command in a real process (``environment``: variables added to its environment): (exit status,
    stderr)."""
    process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.train', *args], cwd=REPO,
                             env=helpers.subprocess_environment(**(environment or {})),
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


# What each source ran, setting by setting (besides batch and peak rate above), written from the sources, not
# from our code. 'train_steps' is the run's length in steps. A setting a source does not state is left out.
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
        cls.free_port = cluster.free_ports(1)[0]
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
        ('data_service_not_an_address', lambda c: ['--data_dir=' + c.data_dir, '--data_service=localhost:5050'],
         'data_service must be grpc://HOST:PORT'),
        ('data_service_unreachable',
         lambda c: ['--data_dir=' + c.data_dir, f'--data_service=grpc://localhost:{c.free_port}'],
         r'cannot reach the tf.data service dispatcher at grpc://localhost:\d+ \(Connection refused\)'),
    )
    def test_bad_input(self, make_args, expected):
        self.assert_one_line_error(SMALL + make_args(self), expected)

    def test_one_line_error_in_a_real_process(self):
        self.assert_one_line_error(SMALL + ['--data_dir=' + self.unreadable_dir], 'cannot read .*train-00001-of-00004',
                                   run=run_main)

    def test_a_tpu_recipe_without_a_tpu_is_one_line_naming_the_fix(self):
        if tf.config.list_logical_devices('TPU'):
            self.skipTest('this machine has a TPU')
        self.assert_one_line_error([f'--flagfile={os.path.join(REPO, "flags", "tpu_v3_8.cfg")}',
                                    '--data_dir=' + self.data_dir],
                                   r'cannot start the TPU system for --tpu=local \(.*tensorflow-tpu.*--strategy=cpu',
                                   run=run_main)

    def test_help_lists_every_setting_by_section_under_the_console_script(self):
        # A console script's __main__ is a generated wrapper, so absl's own --help shows none of our flags:
        # main.run, the console script's entry, prints ours before absl parses anything.
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), self.assertRaises(SystemExit) as exited:
            main.run(['imagenet-tpu-train', '--help'])
        self.assertEqual(exited.exception.code, 0)
        sections = {}
        current = None
        for line in stdout.getvalue().splitlines():
            if line.endswith(':') and not line.startswith(' ') and line[:-1].lower() in config_lib.SECTIONS:
                current = line[:-1].lower()
            elif line.startswith('  --') and current:
                name = line[4:].split('=')[0].split(' ')[0].replace('[no]', '')
                sections[name] = current
        expected = {field.name: field.metadata['section'] for field in dataclasses.fields(Config)}
        self.assertEqual(sections, expected)
        self.assertIn('--global_batch_size=1024', stdout.getvalue())
        self.assertIn('One of: sgd, lars, rmsprop_warmup.', ' '.join(stdout.getvalue().split()))

    @pytest.mark.slow
    def test_command_line_and_python_api_end_with_the_same_weights(self):
        # The seed, op determinism and the strategy are applied by train_and_evaluate itself, so Config(...) in
        # Python runs exactly as the same flags do. Both in fresh processes: the seed and determinism are global.
        settings = dict(data_dir=self.data_dir, depth=10, image_size=16, num_classes=4, num_train_images=48,
                        num_eval_images=20, global_batch_size=16, eval_batch_size=16, train_epochs=1,
                        strategy='cpu', num_cpu_devices=2, seed=5, deterministic=True, log_every_steps=0)
        cli_dir, api_dir = (os.path.join(self.root, name) for name in ('cli', 'api'))
        code, stderr = run_main(*[f'--{name}={value}' for name, value in settings.items()], f'--model_dir={cli_dir}')
        self.assertEqual(code, 0, stderr[-3000:])
        script = ('import imagenet_tpu\nfrom imagenet_tpu import train\nfrom imagenet_tpu.config import Config\n'
                  f'train.train_and_evaluate(Config(model_dir={api_dir!r}, **{settings!r}))\n')
        process = subprocess.run([sys.executable, '-c', script], cwd=REPO, env=helpers.subprocess_environment(),
                                 capture_output=True, text=True, timeout=300)
        self.assertEqual(process.returncode, 0, process.stderr[-3000:])
        cli = helpers.checkpoint_variables(os.path.join(cli_dir, 'checkpoints'))
        api = helpers.checkpoint_variables(os.path.join(api_dir, 'checkpoints'))
        self.assertEqual(sorted(cli), sorted(api))
        for name in cli:
            self.assertAllEqual(cli[name], api[name], msg=name)
        results = []
        for directory in (cli_dir, api_dir):
            with open(os.path.join(directory, 'results.json')) as f:
                results.append(json.load(f))
        self.assertEqual(results[0]['steps'], 3)
        for name in ('train_loss', 'loss', 'top_1'):
            self.assertEqual(results[0][name], results[1][name], name)

    @pytest.mark.slow
    def test_bad_records_are_skipped_counted_and_reported(self):
        data_dir = os.path.join(self.root, 'bad_records')
        helpers.write_bad_dataset(data_dir)
        model_dir = os.path.join(self.root, 'bad_records_run')
        process = subprocess.run(
            [sys.executable, '-m', 'imagenet_tpu.commands.train', f'--data_dir={data_dir}', f'--model_dir={model_dir}',
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
        # absl's own parser would say "FATAL Flags parsing error" and exit with 1 (commands/common.py).
        self.assert_one_line_error(['--flagfile=' + self.flagfile],
                                   "^error: Unknown command line flag 'bogus_setting'$", run=run_main)

    def test_a_task_outside_the_cluster_of_tf_config(self):
        # TensorFlow's own check raises a ValueError deep in MultiWorkerMirroredStrategy (cluster.check_tf_config).
        tf_config = cluster.tf_config(cluster.local_workers(2), 1).replace('"index": 1', '"index": 2')
        self.assert_one_line_error(SMALL + ['--data_dir=' + self.data_dir, '--strategy=multi_worker'],
                                   r'^error: TF_CONFIG task index 2 is outside the cluster: worker has 2 tasks '
                                   r'\(indices 0, 1\)$',
                                   run=functools.partial(run_main, environment={'TF_CONFIG': tf_config}))


if __name__ == '__main__':
    tf.test.main()
