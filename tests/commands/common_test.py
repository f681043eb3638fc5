"""What every command shares (commands/common.py): flags that cannot be parsed, on the command line or in a
--flagfile, and a --flagfile that cannot be read, are one ``error:`` line and exit status 2 in every command (absl's
own parser prints "FATAL Flags parsing error" and exits with 1); --help lists a command's own flags."""

import contextlib
import io
import os
import subprocess
import sys
import tempfile

from absl import flags
from absl import logging as absl_logging
from absl.testing import flagsaver, parameterized
import tensorflow as tf

import helpers
from imagenet_tpu.commands import common
from imagenet_tpu.commands import evaluate as evaluate_command
from imagenet_tpu.commands import plan as plan_command
from imagenet_tpu.commands import train as train_command

helpers.use_eight_cpus()


def exit_and_stderr(function, *args):
    """(exit status, stderr) of ``function(*args)``, which must end the process (SystemExit)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            function(*args)
        except SystemExit as exit_:
            return exit_.code, stderr.getvalue()
    raise AssertionError(f'{function} returned; stderr: {stderr.getvalue()}')


class FlagErrorTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix='flag-errors-', dir=tf.compat.v1.test.get_temp_dir())
        cls.files = {}
        for name, content in (('good', b'--depth=10\n'), ('unknown', b'--depth=10\n--bogus_setting=3\n'),
                              ('bad_value', b'--depth=ten\n'), ('binary', b'\xff\xfe\x00--depth=10\n'),
                              ('nested_missing', b'--flagfile=/nonexistent/inner.cfg\n')):
            cls.files[name] = os.path.join(cls.root, f'{name}.cfg')
            with open(cls.files[name], 'wb') as f:
                f.write(content)
        cls.files['missing'] = os.path.join(cls.root, 'nope.cfg')
        cls.files['directory'] = cls.root

    def assert_one_line_error(self, status, stderr, expected):
        self.assertEqual(status, 2, stderr)
        self.assertNotIn('Traceback', stderr)
        self.assertNotIn('FATAL', stderr)
        lines = stderr.strip().splitlines()
        self.assertLen(lines, 1, stderr)
        self.assertRegex(lines[0], '^error: ' + expected)

    @parameterized.named_parameters(
        ('missing_flagfile', 'missing',
         r"cannot read --flagfile: \[Errno 2\] No such file or directory: '.*nope.cfg'$"),
        ('flagfile_is_a_folder', 'directory', r'cannot read --flagfile: \[Errno 21\] Is a directory'),
        ('missing_flagfile_inside_a_flagfile', 'nested_missing', r'cannot read --flagfile: .*/nonexistent/inner.cfg'),
        ('unknown_flag_in_flagfile', 'unknown', "Unknown command line flag 'bogus_setting'$"),
        ('bad_value_in_flagfile', 'bad_value', r"flag --depth=ten: invalid literal for int\(\) with base 10: 'ten'$"),
        ('flagfile_not_text', 'binary', r'a --flagfile is not UTF-8 text \(invalid start byte at byte 0\)$'),
    )
    def test_parse_flags(self, name, expected):
        flag_values = flags.FlagValues()
        flags.DEFINE_integer('depth', 50, 'Layers.', flag_values=flag_values)
        status, stderr = exit_and_stderr(common.parse_flags, ['command', f'--flagfile={self.files[name]}'],
                                         flag_values)
        self.assert_one_line_error(status, stderr, expected)

    def test_a_good_flagfile_parses_and_leaves_the_arguments(self):
        flag_values = flags.FlagValues()
        flags.DEFINE_integer('depth', 50, 'Layers.', flag_values=flag_values)
        rest = common.parse_flags(['command', f'--flagfile={self.files["good"]}', 'photo.jpg'], flag_values)
        self.assertEqual(rest, ['command', 'photo.jpg'])
        self.assertEqual(flag_values.depth, 10)

    @parameterized.named_parameters(('train', train_command), ('evaluate', evaluate_command), ('plan', plan_command))
    def test_every_command_reports_a_bad_flagfile_in_one_line(self, command):
        # The console scripts' own run(): common.run_with_help, absl's app.run with common.parse_flags.
        levels = absl_logging.get_verbosity(), tf.get_logger().level
        try:
            for name, expected in (('missing', 'cannot read --flagfile: '), ('unknown', 'Unknown command line flag'),
                                   ('bad_value', 'flag --depth=ten: ')):
                with flagsaver.flagsaver():
                    status, stderr = exit_and_stderr(command.run, ['command', f'--flagfile={self.files[name]}'])
                self.assert_one_line_error(status, stderr, expected)
        finally:
            absl_logging.set_verbosity(levels[0])
            tf.get_logger().setLevel(levels[1])

    def test_classify_reports_a_bad_flagfile_in_one_line(self):
        # In a process of its own: imagenet-tpu-classify's --json would clash with imagenet-tpu-plan's here.
        process = subprocess.run([sys.executable, '-m', 'imagenet_tpu.commands.classify',
                                  f'--flagfile={self.files["unknown"]}', 'photo.jpg'], cwd=helpers.REPO,
                                 env=helpers.subprocess_environment(), capture_output=True, text=True, timeout=300)
        self.assert_one_line_error(process.returncode, process.stderr, "Unknown command line flag 'depth'")

    def test_help_lists_the_commands_own_flags(self):
        flag_values = flags.FlagValues()
        flags.DEFINE_string('saved_model', None, 'A SavedModel.', flag_values=flag_values)
        flags.DEFINE_integer('batch_size', 32, 'Images per call.', flag_values=flag_values)
        flags.DEFINE_bool('json', False, 'JSON lines.', flag_values=flag_values)
        text = common.usage('Classifies images.', ('saved_model', 'batch_size', 'json'), training_flags=False,
                            flag_values=flag_values)
        self.assertEqual(text.splitlines()[:3], ['Classifies images.', '', "Flags (--helpfull adds absl's own):"])
        for line in ('  --saved_model (not set by default)', '      A SavedModel.', '  --batch_size=32',
                     '  --[no]json (default: off)'):
            self.assertIn(line, text.splitlines())
        self.assertNotIn('--global_batch_size', text)
        with_training = common.usage('Evaluates.', ('checkpoint',))
        self.assertIn('  --checkpoint=latest', with_training.splitlines())
        self.assertIn('  --global_batch_size=1024', with_training.splitlines())


if __name__ == '__main__':
    tf.test.main()
