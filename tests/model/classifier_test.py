"""Classifier: its training step against a hand-written reference, and 1 device against 8 replicas."""

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.model import classifier as classifier_lib

helpers.use_eight_cpus()

TINY = helpers.tiny_config()


def _batches(count=3, batch=16, size=16, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(count * batch, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, classes, size=count * batch).astype(np.int32)
    return images, labels


class LossTest(tf.test.TestCase):

    def test_smoothed_cross_entropy_matches_keras_builtin(self):
        rng = np.random.default_rng(0)
        logits = rng.normal(size=(6, 10)).astype(np.float32)
        labels = rng.integers(0, 10, size=6)
        reference = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1,
                                                         reduction='none')(tf.one_hot(labels, 10), logits)
        self.assertAllClose(classifier_lib.smoothed_cross_entropy(labels, logits, 0.1), reference, atol=1e-6)


class TrainStepTest(tf.test.TestCase, parameterized.TestCase):

    def test_one_step_equals_hand_computed_sgd(self):
        # Reference: the gradient of mean(smoothed CE) + wd/2 * sum(kernel^2), then one momentum-SGD step
        # (v = g on the first step, w <- w - lr * v), written independently of Classifier.
        network = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, use_bias=True),
                                    keras.layers.BatchNormalization(), keras.layers.GlobalAveragePooling2D(),
                                    keras.layers.Dense(5)])
        images, labels = _batches(1, 8, 8, 5)
        initial = [v.numpy() for v in network.trainable_variables]
        with tf.GradientTape() as tape:
            logits = network(images, training=True)
            targets = tf.one_hot(labels, 5) * 0.8 + 0.2 / 5
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(targets, logits))
            loss += 1e-2 / 2 * sum(tf.reduce_sum(v ** 2) for v in network.trainable_variables if 'kernel' in v.name)
        gradients = tape.gradient(loss, network.trainable_variables)
        expected = [w - 0.5 * g.numpy() for w, g in zip(initial, gradients)]
        for variable, value in zip(network.trainable_variables, initial):
            variable.assign(value)

        classifier = classifier_lib.Classifier(network, global_batch_size=8, weight_decay=1e-2, label_smoothing=0.2)
        classifier.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9))
        classifier.fit(images, labels, batch_size=8, epochs=1, verbose=0, shuffle=False)
        for variable, value in zip(network.trainable_variables, expected):
            self.assertAllClose(variable, value, atol=1e-5)

    @pytest.mark.slow
    def test_four_replicas_end_with_the_same_weights_as_one_device(self):
        # No batch norm (norm='none'): plain BN normalizes per replica, so with BN the two runs would differ
        # by design. Everything else of the step (loss scaling by the global batch, weight decay scaled per
        # replica, label smoothing, gradient summation, momentum, schedule) must agree. (Tracing costs a step's
        # graph per replica: 4 replicas test the same as 8 at half the cost.)
        initial, (single, multi) = helpers.train_same_start(
            [(TINY, tf.distribute.get_strategy()), (TINY, helpers.mirrored(4))])
        helpers.assert_same_training(self, single, multi, initial, atol=1e-5, rtol=1e-4, min_change=1e-3)


if __name__ == '__main__':
    tf.test.main()
