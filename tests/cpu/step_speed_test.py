"""Speed settings that must not change the result: space-to-depth stem, XLA, steps per execution, bfloat16."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.model import classifier as classifier_lib
from imagenet_tpu.data import pipeline as input_pipeline
from imagenet_tpu.model import resnet
from imagenet_tpu import train

helpers.use_eight_cpus()

SMALL = helpers.tiny_config(norm='batch_norm', image_size=32, global_batch_size=8, num_train_images=32,
                            base_learning_rate=0.2, weight_decay=1e-4, label_smoothing=0.0, strategy='default')


class SpaceToDepthTest(tf.test.TestCase):

    def test_stems_agree_for_the_same_weights(self):
        keras.utils.set_random_seed(0)
        standard = resnet.resnet(10, 10, image_size=32)
        folded = resnet.resnet(10, 10, image_size=32, space_to_depth=True)
        for layer in standard.layers:
            weights = layer.get_weights()
            if layer.name == 'stem_conv':      # the 7x7 kernel, padded to the stem's 8x8 variable
                weights = [np.pad(weights[0], [[0, 1], [0, 1], [0, 0], [0, 0]])]
            folded.get_layer(layer.name).set_weights(weights)
        # Non-trivial batch-norm statistics and gammas, so every path of the network matters.
        for model in (standard, folded):
            for layer in model.layers:
                if isinstance(layer, keras.layers.BatchNormalization):
                    layer.gamma.assign(tf.fill(layer.gamma.shape, 0.7))
        images = helpers.pixels(np.random.default_rng(1), (4, 32, 32, 3))
        self.assertAllClose(standard(images, training=False),
                            folded(tf.nn.space_to_depth(images, 2), training=False), atol=1e-4, rtol=1e-4)
        stem = keras.Model(standard.input, standard.get_layer('stem_conv').output)
        folded_stem = keras.Model(folded.input, folded.get_layer('stem_conv').output)
        self.assertAllClose(stem(images), folded_stem(tf.nn.space_to_depth(images, 2)), atol=1e-5, rtol=1e-5)

    def test_pipeline_hands_space_to_depth_batches(self):
        images, _ = next(iter(input_pipeline.synthetic_dataset(dataclasses.replace(SMALL, space_to_depth=True))))
        self.assertEqual(images.shape, (8, 16, 16, 12))


@pytest.mark.slow
class ExecutionSettingsTest(tf.test.TestCase):

    def test_xla_and_steps_per_execution_give_the_same_weights(self):
        settings = ((False, 1), (True, 1), (False, 4))     # (jit_compile, steps_per_execution)
        runs = [(dataclasses.replace(SMALL, jit_compile=jit, steps_per_execution=per_call),
                 tf.distribute.get_strategy()) for jit, per_call in settings]
        dataset = helpers.equivalence_batches(steps=4, batch=8, size=32).repeat()
        initial, (reference, *others) = helpers.train_same_start(runs, steps=4, dataset=dataset)
        for setting, weights in zip(settings[1:], others):
            helpers.assert_same_training(self, reference, weights, initial, atol=1e-4, rtol=1e-3, min_change=1e-3,
                                         msg=f'jit_compile, steps_per_execution = {setting}')


class MixedPrecisionTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_bfloat16_compute_float32_variables_and_loss(self):
        config = dataclasses.replace(SMALL, precision='mixed_bfloat16', base_learning_rate=0.05)
        classifier = train.build_classifier(config)
        network = classifier.network
        self.assertTrue(all(v.dtype == tf.float32 for v in network.variables))
        self.assertEqual(network.get_layer('stage1_block1_conv1').compute_dtype, 'bfloat16')
        bn = network.get_layer('stem_bn')
        self.assertEqual(bn.moving_mean.dtype, tf.float32)
        self.assertEqual(network.output.dtype, tf.float32)       # logits, hence loss, in float32
        self.assertEqual(input_pipeline.image_dtype(config), tf.bfloat16)
        self.assertEqual(keras.mixed_precision.global_policy().name, 'float32')  # restored after the build
        # A tiny problem the network can fit: 8 images, loss falls over 15 steps and stays finite.
        images = tf.cast(helpers.pixels(np.random.default_rng(0), (8, 32, 32, 3)), tf.bfloat16)
        labels = tf.constant(np.arange(8) % 10, tf.int32)
        history = classifier.fit(tf.data.Dataset.from_tensors((images, labels)).repeat(), epochs=1,
                                 steps_per_epoch=15, verbose=0)
        first = classifier_lib.smoothed_cross_entropy(labels, network(images, training=False))
        self.assertTrue(np.isfinite(history.history['loss'][-1]))
        losses = []
        for _ in range(2):
            classifier.fit(tf.data.Dataset.from_tensors((images, labels)).repeat(), epochs=1, steps_per_epoch=15,
                           verbose=0)
            losses.append(float(tf.reduce_mean(classifier_lib.smoothed_cross_entropy(labels, network(images, training=True)))))
        self.assertLess(losses[-1], float(tf.reduce_mean(first)))
        self.assertTrue(np.all(np.isfinite(losses)))

    def test_float16_step_matches_float32_where_unscaled_gradients_underflow(self):
        # The loss of a step is the sum over its images divided by the global batch (classifier_lib.Classifier), so a
        # global batch of 2^20 images makes every gradient of a logit at most 2^-20 (|softmax - target| < 1):
        # float16 subnormals, and the gradients flowing back into the convolutions, smaller still, underflow to
        # 0 in float16. The linear scaling rule's rate (0.4 x 2^20 / 256) keeps the step the size of an ordinary
        # one. No weight decay: its gradient is float32 and would move the weights with or without scaling.
        float32 = helpers.tiny_config(global_batch_size=2 ** 20, weight_decay=0.0)
        float16 = dataclasses.replace(float32, precision='mixed_float16')

        def without_loss_scaling():
            classifier = classifier_lib.Classifier(train.build_network(float16), global_batch_size=float16.global_batch_size,
                                          label_smoothing=float16.label_smoothing)
            classifier.compile(optimizer=train.build_optimizer(float32))     # momentum SGD, no LossScaleOptimizer
            return classifier

        default = tf.distribute.get_strategy()
        initial, (reference, scaled, unscaled) = helpers.train_same_start(
            [(float32, default), (float16, default), (without_loss_scaling, default)], steps=1,
            dataset=helpers.equivalence_batches(steps=1))
        self.assertGreater(max(np.abs(w - w0).max() for w, w0 in zip(reference, initial)), 1e-3)
        for index, (w0, w32, w16, w16_unscaled) in enumerate(zip(initial, reference, scaled, unscaled)):
            change = w32 - w0
            # Tolerance: float16 arithmetic alone makes this network's step differ from float32's by up to 9%
            # (relative norm, per variable; measured at global batch 16, where loss scaling changes nothing).
            error = np.linalg.norm((w16 - w0) - change) / np.linalg.norm(change)
            self.assertLess(error, 0.15, f'weight {index} {w0.shape}')
            if w0.ndim == 4:
                # Without scaling every gradient of a convolution kernel underflowed: the step is lost.
                self.assertAllEqual(w16_unscaled, w0, msg=f'weight {index} {w0.shape}')

    def test_float16_step_with_non_finite_gradients_is_skipped_and_halves_the_loss_scale(self):
        # keras.mixed_precision.LossScaleOptimizer's documented dynamic loss scaling: "If a nonfinite gradient is
        # encountered, the count is reset back to zero, gradients are skipped that step, and the loss scale is
        # halved"; after a step with finite gradients the count is 1 and the scale unchanged (it doubles only
        # after dynamic_growth_steps, 2000, such steps).
        keras.utils.set_random_seed(0)
        classifier = train.build_classifier(helpers.tiny_config(precision='mixed_float16'))
        optimizer = classifier.optimizer
        initial_scale = float(optimizer.loss_scale)
        rng = np.random.default_rng(0)
        images = helpers.pixels(rng, (16, 16, 16, 3))
        labels = rng.integers(0, 10, size=16).astype(np.int32)
        variables = classifier.network.trainable_variables

        def step(batch):
            before = [v.numpy() for v in variables]
            classifier.fit(tf.data.Dataset.from_tensors((batch, labels)), epochs=1, steps_per_epoch=1, verbose=0)
            return before, [v.numpy() for v in variables]

        before, after = step(images)
        self.assertGreater(max(np.abs(a - b).max() for a, b in zip(after, before)), 1e-4)
        self.assertEqual(float(optimizer.loss_scale), initial_scale)
        self.assertEqual(int(optimizer.dynamic_counter), 1)
        images[0, 0, 0, 0] = np.nan         # one pixel: that image's loss, hence every gradient, is NaN
        before, after = step(images)
        for index, (a, b) in enumerate(zip(after, before)):
            self.assertAllEqual(a, b, msg=f'variable {index} changed in a skipped step')
        self.assertEqual(float(optimizer.loss_scale), initial_scale / 2)
        self.assertEqual(int(optimizer.dynamic_counter), 0)


if __name__ == '__main__':
    tf.test.main()
