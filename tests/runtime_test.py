"""Process set-up before TensorFlow: the oneDNN decision, and a start without the no-GPU error line.

The decision is pure logic, tested case by case; what TensorFlow then does with it is checked in fresh processes
against TensorFlow's own report (IsMklEnabled), since the setting only takes effect before TensorFlow is imported.
"""

import os
import platform
import subprocess
import sys
import tempfile

from absl.testing import parameterized
import tensorflow as tf

import helpers
from imagenet_tpu import runtime

X86 = platform.machine().lower() in ('x86_64', 'amd64')
CUINIT_LINE = ('2026-11-30 05:09:59.102098: E external/local_xla/xla/stream_executor/cuda/cuda_platform.cc:51] '
               'failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n')
NO_DRIVER_LINE = ('2026-11-30 05:09:46.426962: I external/local_xla/xla/tsl/cuda/cudart_stub.cc:31] Could not '
                  'find cuda drivers on your machine, GPU will not be used.\n')


def run_python(code: str, **environment):
    """Runs ``code`` in a fresh Python with this checkout on the path, and TF_ENABLE_ONEDNN_OPTS and
    TF_USE_LEGACY_KERAS as given (each unset when not given); returns the completed process."""
    env = helpers.subprocess_environment(TF_CPP_MIN_LOG_LEVEL='2')
    env.pop(runtime.ONEDNN_VARIABLE, None)
    env.pop(runtime.LEGACY_KERAS_VARIABLE, None)
    env.update(environment)
    return subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=helpers.REPO)


MKL_ENABLED = 'from tensorflow.python.util import _pywrap_util_port as p; print(p.IsMklEnabled())'


class OnednnSettingTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ('x86_unset', {}, 'x86_64', False, '1'),
        ('windows_amd64_unset', {}, 'AMD64', False, '1'),
        ('user_said_off', {'TF_ENABLE_ONEDNN_OPTS': '0'}, 'x86_64', False, None),
        ('user_said_on', {'TF_ENABLE_ONEDNN_OPTS': '1'}, 'x86_64', False, None),
        ('arm_keeps_tensorflow_default', {}, 'aarch64', False, None),
        ('too_late_after_tensorflow', {}, 'x86_64', True, None),
    )
    def test_decision(self, environ, machine, imported, expected):
        self.assertEqual(runtime.onednn_setting(environ, machine, imported), expected)

    def test_no_gpu_lines_are_held_back_and_every_other_line_passes(self):
        real = 'E tensorflow/core/framework/op_kernel.cc:1] something real went wrong\n'
        text = NO_DRIVER_LINE + CUINIT_LINE + real + 'Traceback (most recent call last):\n'
        self.assertEqual(runtime.startup_lines_to_show(text, gpu_expected=False),
                         real + 'Traceback (most recent call last):\n')
        # Where a driver is loaded, the cuInit line explains a missing GPU: all of it is shown.
        self.assertEqual(runtime.startup_lines_to_show(text, gpu_expected=True), text)


# Two processors of an x86 /proc/cpuinfo as a hypervisor shows them (a generic name), and an ARM one.
X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx2 avx512f fma
power management:

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f fma
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd sve
CPU part\t: 0xd40
Hardware\t: Neoverse-V1
"""


class CpuDescriptionTest(tf.test.TestCase):

    def write(self, text):
        with tempfile.NamedTemporaryFile('w', suffix='cpuinfo', delete=False) as f:
            f.write(text)
        self.addCleanup(os.remove, f.name)
        return f.name

    def test_family_and_model_number_tell_apart_cpus_of_one_generic_name(self):
        path = self.write(X86_CPUINFO)
        self.assertEqual(runtime.cpu_description(path), {'model': 'AMD EPYC', 'family': '25', 'model_number': '17',
                                                         'flags': 'avx2 avx512f fma fpu sse2'})
        self.assertEqual(runtime.cpu_model(path), 'AMD EPYC (family 25, model 17)')
        zen5 = self.write(X86_CPUINFO.replace('family\t: 25', 'family\t: 26').replace('model\t\t: 17', 'model\t\t: 2'))
        self.assertEqual(runtime.cpu_model(zen5), 'AMD EPYC (family 26, model 2)')

    def test_arm_hardware_and_features_and_no_file(self):
        arm = runtime.cpu_description(self.write(ARM_CPUINFO))
        self.assertEqual((arm['model'], arm['family'], arm['flags']), ('Neoverse-V1', '', 'asimd fp sve'))
        self.assertEqual(runtime.cpu_model(self.write(ARM_CPUINFO)), 'Neoverse-V1')
        missing = runtime.cpu_description('/nonexistent/cpuinfo')
        self.assertEqual(missing['model'], platform.processor() or platform.machine())
        self.assertEqual(missing['flags'], '')


class FreshProcessTest(tf.test.TestCase):

    def test_importing_the_package_first_turns_onednn_on_on_x86(self):
        process = run_python('import imagenet_tpu, tensorflow; ' + MKL_ENABLED)
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        if X86:
            self.assertEqual(process.stdout.split()[-1], 'True')

    def test_the_users_setting_wins(self):
        process = run_python('import imagenet_tpu, tensorflow; ' + MKL_ENABLED, TF_ENABLE_ONEDNN_OPTS='0')
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        self.assertEqual(process.stdout.split()[-1], 'False')

    def test_tensorflow_imported_first_warns_only_where_onednn_is_off(self):
        process = run_python('import tensorflow, imagenet_tpu; ' + MKL_ENABLED)
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        onednn_on = process.stdout.split()[-1] == 'True'    # TensorFlow's own default on this CPU
        self.assertEqual('import imagenet_tpu first' in process.stderr, X86 and not onednn_on, process.stderr)

    def test_importing_the_package_first_makes_tf_keras_tf_keras_without_importing_keras_3(self):
        # TensorFlow's own check of the variable (tf.keras's module path) and Keras 3's package not imported.
        code = ('import sys, imagenet_tpu, tensorflow as tf, tf_keras; '
                'print(tf.keras.layers.Dense is tf_keras.layers.Dense, "keras" in sys.modules)')
        process = run_python(code)
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        self.assertEqual(process.stdout.split()[-2:], ['True', 'False'])
        # The user's setting wins: TF_USE_LEGACY_KERAS=0 keeps TensorFlow's default, Keras 3 as tf.keras.
        process = run_python(code, TF_USE_LEGACY_KERAS='0')
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        self.assertEqual(process.stdout.split()[-2:], ['False', 'True'])

    def test_command_line_starts_without_the_cuinit_line_and_still_shows_errors(self):
        process = run_python('import sys; from imagenet_tpu.commands import train as main; sys.argv = ["imagenet-tpu-train", '
                             '"--synthetic_data", "--depth=10", "--image_size=16", "--global_batch_size=3", '
                             '"--strategy=cpu", "--num_cpu_devices=2"]; main.run()')
        self.assertEqual(process.returncode, 2, process.stderr[-2000:])
        lines = process.stderr.strip().splitlines()
        self.assertEqual(lines[-1], 'error: --global_batch_size=3 is not divisible by the 2 replicas')
        if not runtime.nvidia_driver_present():
            self.assertLen(lines, 1, process.stderr)
        if not runtime.nvidia_driver_present():
            self.assertNotIn('cuInit', process.stderr)

    def test_a_tool_that_imports_tensorflow_inside_absl_app_run_starts_quietly(self):
        # Under absl's app.run TensorFlow probes CUDA while it is imported (the benchmarks' runtime.report()).
        process = run_python('from absl import app\nfrom imagenet_tpu import runtime\n'
                             'app.run(lambda argv: print(runtime.onednn_enabled()))')
        self.assertEqual(process.returncode, 0, process.stderr[-2000:])
        if not runtime.nvidia_driver_present():
            self.assertEqual(process.stderr, '')


if __name__ == '__main__':
    tf.test.main()


class MallocArenasTest(tf.test.TestCase):

    def test_one_arena_per_core_and_at_least_two(self):
        # 2 arenas on the 2-core machine the cap was measured on; a 96-core TPU VM host keeps 96 for its decoders.
        self.assertEqual([runtime.malloc_arenas(cores) for cores in (None, 1, 2, 8, 96)], [2, 2, 2, 8, 96])
