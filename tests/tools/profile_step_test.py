"""tools/benchmarks/profile_step.py: oneDNN's execution log of known convolutions and matrix products, parsed into
the FLOPs their shapes give and the time the log states."""

import os
import subprocess
import sys
import textwrap

import tensorflow as tf

import helpers

sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'benchmarks'))
import profile_step  # pylint: disable=wrong-import-position

# A stride-2 convolution of 2 images of 9x9x3 by 5 filters of 3x3 (SAME: 5x5 outputs), its two gradients, and a
# [6, 4] x [4, 7] matrix product, each run `steps` times under oneDNN's log, after the mark.
_PROGRAM = textwrap.dedent('''
    import ctypes, sys
    from imagenet_tpu import runtime     # the package's oneDNN setting, before TensorFlow
    import tensorflow as tf
    x, w = tf.random.normal([2, 9, 9, 3]), tf.random.normal([3, 3, 3, 5])
    a, b = tf.random.normal([6, 4]), tf.random.normal([4, 7])
    def run():
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, strides=2, padding='SAME')
        tape.gradient(y, [x, w])
        tf.matmul(a, b)
    run()
    ctypes.CDLL(None).fflush(None)
    print(%r, flush=True)
    for _ in range(%d):
        run()
    ''')


class ParseLogTest(tf.test.TestCase):

    def test_flops_and_times_of_a_real_log(self):
        steps = 3
        env = dict(os.environ, ONEDNN_VERBOSE='profile_exec', TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=helpers.REPO)
        done = subprocess.run([sys.executable, '-c', _PROGRAM % (profile_step._MARK, steps)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True)
        lines = done.stdout.splitlines()
        after = lines[lines.index(profile_step._MARK) + 1:]
        figures = profile_step.parse_log(after, steps)
        kinds = figures['kinds']
        convolution = 2 * 2 * 5 * 5 * 3 * 5 * 3 * 3 / 1e9     # images, output pixels, in, out, filter taps
        for kind in ('convolution forward', 'convolution backward-data', 'convolution backward-weights'):
            self.assertAllClose(kinds[kind]['gflop'], convolution, rtol=1e-3, msg=kind)
        self.assertAllClose(kinds['matrix product']['gflop'], 2 * 6 * 4 * 7 / 1e9, rtol=1e-3)
        # The times: the log's own figures of the lines after the mark, summed per kind, per step.
        stated = sum(float(line.split(',')[-1]) for line in after if ',exec,' in line)
        self.assertAllClose(sum(kind['ms'] for kind in kinds.values()), stated / steps, rtol=1e-3, atol=0.02)
        forward = [row for row in figures['primitives'] if row['kind'] == 'convolution forward']
        self.assertEqual([row['per_step'] for row in forward], [1.0])
        self.assertIn('mb2_', forward[0]['shape'])

    def test_shapes_of_grouped_batched_and_other_primitives(self):
        grouped = 'mb4_g2ic8oc6_ih5oh5kh3sh1dh0ph1_iw5ow5kw3sw1dw0pw1'
        self.assertEqual(profile_step.primitive_flops('convolution', grouped), 2 * 4 * 8 * 6 // 2 * 5 * 5 * 3 * 3)
        self.assertEqual(profile_step.primitive_flops('matmul', '3x6x4:3x4x7'), 2 * 3 * 6 * 4 * 7)
        self.assertEqual(profile_step.primitive_flops('batch_normalization', 'mb32ic64ih64iw64'), 0)


if __name__ == '__main__':
    tf.test.main()
