"""Our one-kernel momentum SGD against tf_keras's SGD and a NumPy form of its update: step by step on a changing
learning rate, with and without Nesterov, under 2 replicas, XLA-compiled (the lowering TPUs use), sparse gradients,
and checkpoints shared both ways."""

import os

import numpy as np
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.optim import sgd

helpers.use_eight_cpus()


def momentum_numpy(w, m, g, lr, momentum, nesterov):
    m = momentum * m - lr * g
    return (w + momentum * m - lr * g if nesterov else w + m), m


def decaying_rate():
    return keras.optimizers.schedules.PolynomialDecay(0.5, decay_steps=6, end_learning_rate=0.05)


class SGDTest(tf.test.TestCase):

    def run_steps(self, optimizer, gradients, w0, function=None):
        variable = tf.Variable(w0)

        def step(g):
            optimizer.apply_gradients([(g, variable)])
        step = function(step) if function else step
        values = []
        for g in gradients:
            step(tf.constant(g))
            values.append(variable.numpy().copy())
        return values

    def test_dense_steps_match_tf_keras_sgd_and_numpy(self):
        rng = np.random.default_rng(0)
        w0 = rng.normal(size=(3, 4)).astype(np.float32)
        gradients = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(6)]
        for nesterov in (False, True):
            ours = self.run_steps(sgd.SGD(decaying_rate(), momentum=0.9, nesterov=nesterov), gradients, w0)
            theirs = self.run_steps(keras.optimizers.SGD(decaying_rate(), momentum=0.9, nesterov=nesterov),
                                    gradients, w0)
            w, m = w0.astype(np.float64), np.zeros((3, 4))
            for step, (g, mine, keras_w) in enumerate(zip(gradients, ours, theirs)):
                w, m = momentum_numpy(w, m, g, float(decaying_rate()(step)), 0.9, nesterov)
                self.assertAllClose(mine, w, rtol=1e-5, atol=1e-6)
                self.assertAllClose(mine, keras_w, rtol=1e-6, atol=1e-7)
            self.assertGreater(np.abs(ours[-1] - w0).max(), 0.5)     # the weights moved

    def test_xla_compiled_steps_match(self):
        # tf.function(jit_compile=True) lowers the kernel with tf2xla, as TPUs and --jit_compile on GPUs do.
        rng = np.random.default_rng(1)
        w0 = rng.normal(size=(7,)).astype(np.float32)
        gradients = [rng.normal(size=(7,)).astype(np.float32) for _ in range(4)]
        compiled = self.run_steps(sgd.SGD(decaying_rate(), momentum=0.9), gradients, w0,
                                  function=lambda f: tf.function(f, jit_compile=True))
        eager = self.run_steps(keras.optimizers.SGD(decaying_rate(), momentum=0.9), gradients, w0)
        self.assertAllClose(compiled, eager, rtol=1e-6, atol=1e-7)

    def test_sparse_gradients_and_no_momentum_take_keras_path(self):
        rng = np.random.default_rng(2)
        table = rng.normal(size=(5, 3)).astype(np.float32)
        results = []
        for optimizer in (sgd.SGD(0.1, momentum=0.9), keras.optimizers.SGD(0.1, momentum=0.9),
                          sgd.SGD(0.1), keras.optimizers.SGD(0.1)):
            variable = tf.Variable(table)
            for rows in ([0, 2], [2, 4]):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.gather(variable, rows) ** 2)
                gradient = tape.gradient(loss, variable)
                optimizer.apply_gradients([(gradient, variable)])
            results.append(variable.numpy())
        self.assertIsInstance(gradient, tf.IndexedSlices)
        self.assertAllClose(results[0], results[1])
        self.assertAllClose(results[2], results[3])
        self.assertNotAllClose(results[0], table)

    def test_two_replicas_match_one_device(self):
        # Under MirroredStrategy the update runs on each replica's copy of the variable and of its momentum.
        rng = np.random.default_rng(3)
        w0 = rng.normal(size=(4,)).astype(np.float32)
        gradients = [rng.normal(size=(4,)).astype(np.float32) for _ in range(3)]
        strategy = helpers.mirrored(2)
        with strategy.scope():
            variable = tf.Variable(w0)
            optimizer = sgd.SGD(decaying_rate(), momentum=0.9, nesterov=True)

        @tf.function
        def step(g):
            strategy.run(lambda: optimizer.apply_gradients([(g, variable)]))
        for g in gradients:
            step(tf.constant(g))
        reference = self.run_steps(keras.optimizers.SGD(decaying_rate(), momentum=0.9, nesterov=True),
                                   gradients, w0)[-1]
        for replica_value in strategy.experimental_local_results(variable):
            self.assertAllClose(replica_value, reference, rtol=1e-6, atol=1e-7)

    def test_checkpoints_restore_into_tf_keras_sgd_and_back(self):
        rng = np.random.default_rng(4)
        w0 = rng.normal(size=(6,)).astype(np.float32)
        gradients = [rng.normal(size=(6,)).astype(np.float32) for _ in range(4)]
        path = os.path.join(self.get_temp_dir(), 'ckpt')
        for first, second in ((sgd.SGD, keras.optimizers.SGD), (keras.optimizers.SGD, sgd.SGD)):
            variable, optimizer = tf.Variable(w0), first(0.1, momentum=0.9)
            for g in gradients[:2]:
                optimizer.apply_gradients([(tf.constant(g), variable)])
            saved = tf.train.Checkpoint(variable=variable, optimizer=optimizer).write(path)
            restored_variable, restored = tf.Variable(np.zeros(6, np.float32)), second(0.1, momentum=0.9)
            restored.build([restored_variable])
            tf.train.Checkpoint(variable=restored_variable, optimizer=restored).read(saved).assert_consumed()
            for g in gradients[2:]:
                optimizer.apply_gradients([(tf.constant(g), variable)])
                restored.apply_gradients([(tf.constant(g), restored_variable)])
            self.assertAllClose(restored_variable, variable, rtol=1e-6, atol=1e-7)


if __name__ == '__main__':
    tf.test.main()
