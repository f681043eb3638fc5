"""convolution.Conv2D and its formulations against TensorFlow's convolution op and its registered gradients, and
Keras's Conv2D layer."""

import itertools
import os
import tempfile
from unittest import mock

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras as keras
from tensorflow.python.framework import config as tf_config

import helpers
from imagenet_tpu.cpu import convolution
from imagenet_tpu.cpu import native
from imagenet_tpu.cpu import tuning
from imagenet_tpu.model import resnet
from imagenet_tpu.cpu.convolution import Problem

helpers.use_eight_cpus()

PROBLEMS = {
    '1x1': Problem(2, 8, 8, 4, 6, (1, 1), (1, 1), 'SAME'),
    '1x1_stride2_odd': Problem(2, 9, 7, 4, 6, (1, 1), (2, 2), 'SAME'),
    '1x1_stride2_valid': Problem(2, 9, 7, 4, 6, (1, 1), (2, 2), 'VALID'),
    '3x3': Problem(2, 8, 8, 4, 6, (3, 3), (1, 1), 'SAME'),
    '3x3_stride2_odd': Problem(2, 9, 8, 4, 6, (3, 3), (2, 2), 'SAME'),
    '3x3_stride2_valid': Problem(2, 9, 8, 4, 6, (3, 3), (2, 2), 'VALID'),
    '7x7_stride2': Problem(2, 16, 16, 3, 5, (7, 7), (2, 2), 'SAME'),
    '3x1_strides_2_1_valid': Problem(3, 10, 11, 3, 5, (3, 1), (2, 1), 'VALID'),
    # Stride 1 with other paddings, for the input gradient as a correlation of dY: VALID, and SAME of an even
    # filter (padded unevenly: 0 before and 1 after the rows, 1 and 2 around the columns).
    '3x3_valid': Problem(2, 8, 7, 4, 6, (3, 3), (1, 1), 'VALID'),
    '2x4_same': Problem(2, 7, 9, 3, 5, (2, 4), (1, 1), 'SAME'),
    # Winograd's tiles of 2x2 outputs on maps of odd sizes (the last tiles half outside) and of one pixel.
    '3x3_odd': Problem(2, 7, 5, 4, 6, (3, 3), (1, 1), 'SAME'),
    '3x3_one_pixel': Problem(1, 1, 1, 4, 6, (3, 3), (1, 1), 'SAME'),
}


def tensorflow_reference(x, w, dy, problem):
    """Output and gradients (input, filter) of tf.nn.conv2d, by TensorFlow's registered gradients."""
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = tf.nn.conv2d(x, w, strides=problem.strides, padding=problem.padding)
    return [y, *tape.gradient(y, [x, w], output_gradients=dy)]


def formulations(x, w, dy, problem, choice):
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = convolution.convolve(x, w, problem, choice)
    return [y, *tape.gradient(y, [x, w], output_gradients=dy)]


def graph_ops(layer, x):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return y, tape.gradient(y, [x, layer.kernel])
    return {op.type for op in step.get_concrete_function(x).graph.get_operations()}


class FormulationTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(*PROBLEMS.items())
    def test_every_formulation_equals_tensorflow(self, problem):
        rng = np.random.default_rng(0)
        x, w, dy = (tf.constant(rng.normal(size=shape), tf.float32)
                    for shape in (problem.input_shape, problem.filter_shape, problem.output_shape))
        expected = tensorflow_reference(x, w, dy, problem)
        self.assertEqual(tuple(expected[0].shape), problem.output_shape)
        combinations = list(itertools.product(*convolution.candidates(problem).values()))
        self.assertGreater(len(combinations), 1)
        for names in combinations:
            got = formulations(x, w, dy, problem, dict(zip(convolution.PARTS, names)))
            for part, value, reference in zip(('output', 'input gradient', 'filter gradient'), got, expected):
                self.assertAllClose(value, reference, atol=2e-5, rtol=1e-5, msg=f'{names}: {part}')

    @parameterized.named_parameters(*PROBLEMS.items(),
                                    ('5x3_stride3_2_odd', Problem(2, 11, 10, 3, 4, (5, 3), (3, 2), 'SAME')),
                                    ('4x4_stride3_valid', Problem(1, 13, 9, 2, 4, (4, 4), (3, 3), 'VALID')))
    def test_patch_rows_are_extract_patches(self, problem):
        x = tf.constant(np.random.default_rng(1).normal(size=problem.input_shape), tf.float32)
        expected = tf.image.extract_patches(x, sizes=[1, *problem.kernel, 1], strides=[1, *problem.strides, 1],
                                            rates=[1, 1, 1, 1], padding=problem.padding)
        got = convolution._patch_rows(x, problem.kernel, problem.strides, problem.padding)  # pylint: disable=protected-access
        self.assertAllEqual(got, tf.reshape(expected, [-1, expected.shape[-1]]))

    def test_candidates(self):
        self.assertEqual(convolution.candidates(PROBLEMS['1x1']),
                         {'forward': ('convolution', 'matmul'), 'input_gradient': ('convolution', 'matmul'),
                          'filter_gradient': ('convolution', 'matmul', 'matmul_swapped')})
        # Strided 1x1 too: the input gradient as a matrix product spread over the pixels the filter read.
        self.assertEqual(convolution.candidates(PROBLEMS['1x1_stride2_odd'])['input_gradient'],
                         ('convolution', 'matmul'))
        # 3x3, stride 1, SAME: also Winograd's, where our kernels load.
        winograd = ('winograd',) if native.available() else ()
        self.assertEqual(convolution.candidates(PROBLEMS['3x3']),
                         {'forward': ('convolution', 'im2col', *winograd),
                          'input_gradient': ('convolution', 'im2col', *winograd),
                          'filter_gradient': ('convolution', 'swapped', 'im2col', *winograd)})
        with mock.patch.object(native, 'available', lambda: False):
            self.assertEqual(convolution.candidates(PROBLEMS['3x3']),
                             {'forward': ('convolution', 'im2col'), 'input_gradient': ('convolution', 'im2col'),
                              'filter_gradient': ('convolution', 'swapped', 'im2col')})
        for name in ('3x3_valid', '3x3_stride2_odd', '2x4_same'):
            self.assertNotIn('winograd', convolution.candidates(PROBLEMS[name])['forward'], name)
        # Strided: the input gradient is TensorFlow's op.
        self.assertEqual(convolution.candidates(PROBLEMS['3x3_stride2_odd'])['input_gradient'], ('convolution',))
        # Patch matrices over MAX_PATCH_VALUES_PER_IMAGE or MAX_PATCH_VALUES: no 'im2col'. ResNet-50's stem at
        # 128 px (602,112 values an image), its last stage at 224 px and batch 32 (225,792) and 256 (58 million).
        no_im2col = {'forward': ('convolution',), 'input_gradient': ('convolution',),
                     'filter_gradient': ('convolution', 'swapped')}
        self.assertEqual(convolution.candidates(Problem(32, 128, 128, 3, 64, (7, 7), (2, 2), 'SAME')), no_im2col)
        self.assertEqual(convolution.candidates(Problem(32, 7, 7, 512, 512, (3, 3), (1, 1), 'SAME'))['forward'],
                         ('convolution', 'im2col', *winograd))
        self.assertEqual(convolution.candidates(Problem(256, 7, 7, 512, 512, (3, 3), (1, 1), 'SAME')),
                         {part: (*names, *winograd) for part, names in no_im2col.items()})

    def test_problem_shapes_follow_tensorflow(self):
        for problem in PROBLEMS.values():
            x = tf.zeros(problem.input_shape)
            y = tf.nn.conv2d(x, tf.zeros(problem.filter_shape), problem.strides, problem.padding)
            self.assertEqual(problem.output_shape, tuple(y.shape))
            rows, columns = problem.output_size
            self.assertEqual(problem.multiply_adds, np.prod(problem.filter_shape) * problem.batch * rows * columns)


def winograd_tiles(x):
    """NumPy: x [N, H, W, C] -> [16, T, C], each tile's Bt d B (Lavin and Gray 2016, F(2x2, 3x3)), tiles of 2x2
    outputs in (image, row, column) order, each reading its 4x4 pixels from one before it, zeros outside."""
    bt = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
    n, h, w, c = x.shape
    rows, columns = -(-h // 2), -(-w // 2)
    padded = np.zeros((n, 2 * rows + 2, 2 * columns + 2, c))
    padded[:, 1:h + 1, 1:w + 1] = x
    tiles = [bt @ padded[i, 2 * a:2 * a + 4, 2 * b:2 * b + 4].transpose(2, 0, 1) @ bt.T
             for i in range(n) for a in range(rows) for b in range(columns)]       # each [C, 4, 4]
    return np.stack(tiles).reshape(len(tiles), c, 16).transpose(2, 0, 1)


class WinogradKernelTest(tf.test.TestCase):
    """kernels/winograd.cc's transforms: the input's against NumPy, and each backward transform as the adjoint of
    its forward one (<f(a), b> = <a, f*(b)> for random a and b), which is what makes the gradients exact."""

    def setUp(self):
        super().setUp()
        if not native.available():
            self.skipTest('our kernels do not build on this machine (no C++ compiler)')
        self.kernels = native.library()
        self.rng = np.random.default_rng(5)

    def normal(self, *shape):
        return tf.constant(self.rng.normal(size=shape), tf.float32)

    def test_input_tiles_are_numpys(self):
        for shape in ((2, 6, 4, 3), (1, 5, 7, 2), (1, 1, 1, 1)):
            x = self.normal(*shape)
            self.assertAllClose(self.kernels.imagenet_tpu_winograd_input(x), winograd_tiles(x.numpy()),
                                atol=1e-5, msg=str(shape))

    def test_backward_transforms_are_the_adjoints(self):
        k = self.kernels

        def check(forward, backward, a, b):
            self.assertAllClose(tf.reduce_sum(forward(a) * b), tf.reduce_sum(a * backward(b)), rtol=1e-4)

        for n, h, w, c in ((2, 6, 4, 3), (1, 5, 7, 2)):
            tiles = n * -(-h // 2) * -(-w // 2)
            check(k.imagenet_tpu_winograd_input,
                  lambda v, h=h, w=w: k.imagenet_tpu_winograd_input_grad(v, height=h, width=w),
                  self.normal(n, h, w, c), self.normal(16, tiles, c))
            check(k.imagenet_tpu_winograd_output_grad,
                  lambda m, h=h, w=w: k.imagenet_tpu_winograd_output(m, height=h, width=w),
                  self.normal(n, h, w, c), self.normal(16, tiles, c))
        check(k.imagenet_tpu_winograd_filter, k.imagenet_tpu_winograd_filter_grad, self.normal(3, 3, 5, 4),
              self.normal(16, 5, 4))

    def test_bad_shapes_are_one_line_errors(self):
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'not whole images of 4x4'):
            self.kernels.imagenet_tpu_winograd_output(self.normal(16, 5, 3), height=4, width=4)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r'expected a filter \[3, 3, C, F\]'):
            self.kernels.imagenet_tpu_winograd_filter(self.normal(5, 5, 2, 2))


class TuningTest(tf.test.TestCase):

    def test_fastest_takes_another_formulation_only_beyond_the_margin(self):
        seconds = {'forward': {'convolution': 1.0, 'matmul': 0.5},
                   'input_gradient': {'convolution': 1.0, 'matmul': 0.99},
                   'filter_gradient': {'convolution': 1.0, 'matmul': 1.5, 'swapped': 0.96}}
        self.assertEqual(convolution.fastest(seconds),
                         {'forward': 'matmul', 'input_gradient': 'convolution', 'filter_gradient': 'swapped'})

    def test_measure_times_every_candidate(self):
        problem = PROBLEMS['1x1']
        seconds = convolution.measure(problem, repeats=1)
        self.assertEqual({part: tuple(times) for part, times in seconds.items()}, convolution.candidates(problem))
        self.assertTrue(all(0 < t < 10 for times in seconds.values() for t in times.values()), seconds)

    def test_shortest_in_turns_warms_up_then_takes_turns(self):
        # Each run records itself and moves a fake clock on by its next duration: one untimed call each, then
        # ``repeats`` turns in which every run is called once, and each run's shortest timed call.
        clock, order = [0.0], []
        durations = {'a': iter([9.0, 0.3, 0.1, 0.2]), 'b': iter([9.0, 0.5, 0.6, 0.4])}

        def run(name):
            def call():
                order.append(name)
                clock[0] += next(durations[name])
            return call

        with mock.patch.object(tuning.time, 'perf_counter', lambda: clock[0]):
            best = tuning.shortest_in_turns({'a': run('a'), 'b': run('b')}, repeats=3)
        self.assertEqual(order, ['a', 'b'] * 4)
        self.assertAlmostEqual(best['a'], 0.1)
        self.assertAlmostEqual(best['b'], 0.4)

    def test_each_time_is_of_its_own_formulation(self):
        # Each formulation is made to add its own offset to its result: every run that measure times under a
        # formulation's name must compute that formulation (a run bound to another name's function would not).
        # (That the runs take turns is shortest_in_turns's test.)
        problem = PROBLEMS['3x3']
        names = sorted({name for names in convolution.candidates(problem).values() for name in names})
        timed = []

        def offset(original):
            def run(formulation, *args):
                return original(formulation, *args) + 1000.0 * names.index(formulation)
            return run

        def record(runs, repeats):
            timed.append({name: [run() for _ in range(repeats)] for name, run in runs.items()})
            return {name: 1.0 for name in runs}

        with mock.patch.multiple(convolution, **{part: offset(getattr(convolution, part))
                                                 for part in convolution.PARTS}), \
                mock.patch.object(tuning, 'shortest_in_turns', record):
            convolution.measure(problem, repeats=2)
        self.assertEqual([tuple(runs) for runs in timed], list(convolution.candidates(problem).values()))
        for runs in timed:
            for name, values in runs.items():
                for value in values:     # normal maps: every value of a result is far from the next offset
                    self.assertLess(np.abs(value - 1000.0 * names.index(name)).max(), 500.0, name)

    def test_choose_measures_each_problem_once(self):
        problem = Problem(7, 5, 5, 3, 2, (1, 1), (1, 1), 'SAME')   # used by no other test
        calls = []

        def fake_measure(p):
            calls.append(p)
            return {'forward': {'convolution': 2.0, 'matmul': 1.0}, 'input_gradient': {'convolution': 1.0},
                    'filter_gradient': {'convolution': 1.0, 'matmul': 3.0}}

        for _ in range(2):
            self.assertEqual(convolution.choose(problem, fake_measure),
                             {'forward': 'matmul', 'input_gradient': 'convolution', 'filter_gradient': 'convolution'})
        self.assertEqual(calls, [problem])


class Conv2DTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.x = tf.constant(np.random.default_rng(1).normal(size=(4, 12, 12, 8)), tf.float32)

    def layers(self, **kwargs):
        """Ours and Keras's Conv2D with the same kernel."""
        ours = convolution.Conv2D(16, 1, padding='same', use_bias=False, **kwargs)
        theirs = keras.layers.Conv2D(16, 1, padding='same', use_bias=False)
        ours(self.x), theirs(self.x)
        theirs.kernel.assign(ours.kernel)
        return ours, theirs

    def test_uses_the_tuned_choice_and_equals_keras(self):
        ours, theirs = self.layers(cpu_tuning=True)
        problem = Problem(4, 12, 12, 8, 16, (1, 1), (1, 1), 'SAME')
        choice = {'forward': 'matmul', 'input_gradient': 'matmul', 'filter_gradient': 'matmul'}
        with mock.patch.object(convolution, 'MIN_MULTIPLY_ADDS', 0), \
                mock.patch.dict(convolution._choices, {problem: choice}):
            self.assertEqual(ours.problem(self.x), problem)
            ops = graph_ops(ours, self.x)
            self.assertIn('MatMul', ops)
            self.assertFalse({'Conv2D', 'Conv2DBackpropInput', 'Conv2DBackpropFilter'} & ops, ops)
            results = []
            for layer in (ours, theirs):
                with tf.GradientTape() as tape:
                    tape.watch(self.x)
                    y = layer(self.x)
                    loss = tf.reduce_sum(y ** 2)
                results.append([y, *tape.gradient(loss, [self.x, layer.kernel])])
            for got, expected in zip(*results):
                self.assertAllClose(got, expected, atol=1e-4, rtol=1e-5)

    def test_keras_kernels_where_tuning_does_not_apply(self):
        ours, _ = self.layers(cpu_tuning=True)
        problem = Problem(4, 12, 12, 8, 16, (1, 1), (1, 1), 'SAME')
        matmuls = {'forward': 'matmul', 'input_gradient': 'matmul', 'filter_gradient': 'matmul'}
        with mock.patch.dict(convolution._choices, {problem: matmuls}):
            self.assertIsNone(ours.problem(self.x))          # below MIN_MULTIPLY_ADDS
            with mock.patch.object(convolution, 'MIN_MULTIPLY_ADDS', 0):
                self.assertIn('MatMul', graph_ops(ours, self.x))
                untuned, _ = self.layers(cpu_tuning=False)
                self.assertIsNone(untuned.problem(self.x))
                self.assertNotIn('MatMul', graph_ops(untuned, self.x))
                self.assertIsNone(ours.problem(tf.cast(self.x, tf.float64)))
                tf_config.enable_op_determinism()
                try:
                    self.assertFalse(convolution.tuning_applies())
                    self.assertNotIn('MatMul', graph_ops(ours, self.x))
                finally:
                    tf_config.disable_op_determinism()
                self.assertTrue(convolution.tuning_applies())
                with helpers.mirrored(2).scope():     # choices made before the replicas run are used ...
                    self.assertTrue(convolution.tuning_applies())
                    self.assertFalse(convolution.may_measure_now())    # ... but none is timed while they trace

    def test_tuned_by_default_on_a_cpu_machine(self):
        layer = convolution.Conv2D(4, 3)
        layer.build((None, 8, 8, 3))
        self.assertEqual(layer._tune, not tf.config.list_physical_devices('GPU'))
        self.assertIsNone(layer.get_config()['cpu_tuning'])   # decided where the layer is built

    def test_keras_checkpoint_loads(self):
        ours, theirs = self.layers()
        theirs.kernel.assign(theirs.kernel + 1.0)
        path = tf.train.Checkpoint(layer=theirs).write(os.path.join(self.get_temp_dir(), 'keras'))
        tf.train.Checkpoint(layer=ours).read(path).assert_consumed()
        self.assertAllEqual(ours.kernel, theirs.kernel)


def small_resnets(seed):
    """Random images [4, 32, 32, 3] and two ResNet-18s of the same weights: with tuned convolutions, and Keras's."""
    images = tf.constant(np.random.default_rng(seed).uniform(0, 255, size=(4, 32, 32, 3)), tf.float32)
    networks = [resnet.resnet(18, 10, image_size=32, tune_convolutions=tune) for tune in (True, False)]
    networks[1].set_weights(networks[0].get_weights())
    return images, networks


def loss_gradients(network, images):
    """The gradients of a loss of ``network``'s training-mode output, in one traced step."""
    @tf.function
    def step(images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(network(images, training=True)))
        return tape.gradient(loss, network.trainable_variables)
    return step(images)


class ResNetTuningTest(tf.test.TestCase):

    def test_tuned_resnet_step_equals_the_untuned_one(self):
        """A real tuning run on a small ResNet: every convolution problem of the step is measured, and the
        network's loss gradients equal those of the same network with Keras's convolutions."""
        images, networks = small_resnets(seed=2)
        with mock.patch.object(convolution, 'MIN_MULTIPLY_ADDS', 0), \
                mock.patch.dict(convolution._choices, clear=True):
            tuned = loss_gradients(networks[0], images)
            problems = dict(convolution._choices)
        expected = {Problem(4, *layer.input_shape[1:], layer.filters, layer.kernel_size, layer.strides, 'SAME')
                    for layer in networks[0].layers if isinstance(layer, convolution.Conv2D)}
        self.assertEqual(set(problems), expected)
        for problem, choice in problems.items():
            self.assertEqual(problem.batch, 4)
            for part, name in choice.items():
                self.assertIn(name, convolution.candidates(problem)[part])
        for got, expected in zip(tuned, loss_gradients(networks[1], images)):
            self.assertAllClose(got, expected, atol=1e-3, rtol=1e-4)

    def test_winograd_resnet_step_equals_keras(self):
        """A small ResNet with 'winograd' for every computation of its 3x3 stride-1 convolutions (in the step's
        function, where the graph optimizer merges the transforms that the forward pass and the two gradients share)
        has the loss gradients of the same network with Keras's convolutions."""
        if not native.available():
            self.skipTest('our kernels do not build on this machine (no C++ compiler)')
        images, networks = small_resnets(seed=3)
        chosen = []

        def choose(problem, measure_fn=None, may_measure=True):
            name = 'winograd' if convolution.winograd_applies(problem) else 'convolution'
            chosen.append(name)
            return {part: name for part in convolution.PARTS}

        with mock.patch.object(convolution, 'MIN_MULTIPLY_ADDS', 0), mock.patch.object(convolution, 'choose', choose):
            tuned = loss_gradients(networks[0], images)
        self.assertEqual(chosen.count('winograd'), 13)     # ResNet-18's 3x3 stride-1 convolutions: 16 less 3 strided
        for got, expected in zip(tuned, loss_gradients(networks[1], images)):
            self.assertAllClose(got, expected, atol=1e-3, rtol=1e-4)

    def test_tune_network_before_training(self):
        network = resnet.resnet(18, 10, image_size=32)
        expected = {Problem(6, *layer.input_shape[1:], layer.filters, layer.kernel_size, layer.strides, 'SAME')
                    for layer in network.layers if isinstance(layer, convolution.Conv2D)}
        measured = []

        def fake_measure(problem):
            measured.append(problem)
            return {part: {name: 1.0 + index for index, name in enumerate(names)}
                    for part, names in convolution.candidates(problem).items()}

        with mock.patch.object(convolution, 'MIN_MULTIPLY_ADDS', 0), \
                mock.patch.object(convolution, 'measure', fake_measure), \
                mock.patch.dict(convolution._choices, clear=True), \
                mock.patch.object(tuning, 'CACHE', tuning.Cache()), \
                mock.patch.dict(os.environ, {tuning.ENVIRONMENT: tempfile.mkdtemp(dir=self.get_temp_dir())}):
            tf_config.enable_op_determinism()
            try:
                self.assertEqual(convolution.tune_network(network, 6), {})
            finally:
                tf_config.disable_op_determinism()
            self.assertEqual(measured, [])
            # Several replicas share the per-replica problems: timed here, before any replica runs.
            choices = convolution.tune_network(network, 6, num_replicas=2)
            self.assertEqual(set(choices), expected)
            self.assertCountEqual(measured, expected)          # each problem once
            self.assertTrue(all(name == 'convolution' for choice in choices.values() for name in choice.values()))
            # A new process on this machine (the choices of this one forgotten) reads them from the cache.
            convolution._choices.clear()
            tuning.CACHE.reset()
            self.assertEqual(convolution.tune_network(network, 6), choices)
            self.assertCountEqual(measured, expected)

    def test_a_problem_not_yet_timed_is_not_timed_under_several_replicas(self):
        problem = Problem(3, 5, 5, 3, 2, (1, 1), (1, 1), 'SAME')   # used by no other test

        def fail(p):
            raise AssertionError('timed while replicas trace')

        with mock.patch.object(tuning, 'CACHE', tuning.Cache()), \
                mock.patch.dict(os.environ, {tuning.ENVIRONMENT: 'off'}):
            self.assertEqual(convolution.choose(problem, fail, may_measure=False),
                             {part: 'convolution' for part in convolution.PARTS})
            with helpers.mirrored(2).scope():
                self.assertFalse(convolution.may_measure_now())
            self.assertTrue(convolution.may_measure_now())


if __name__ == '__main__':
    tf.test.main()
