"""Speed settings that must not change the result: space-to-depth stem, XLA, steps per execution, bfloat16."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu import input_pipeline, resnet, train
from imagenet_tpu.config import Config

helpers.use_eight_cpus()

SMALL = Config(depth=10, num_classes=10, image_size=32, global_batch_size=8, num_train_images=32, warmup_epochs=0,
               lr_decay='cosine', base_learning_rate=0.2, train_epochs=1, weight_decay=1e-4, strategy='default')


class SpaceToDepthTest(tf.test.TestCase):

    def test_stems_agree_for_the_same_weights(self):
        keras.utils.set_random_seed(0)
        standard = resnet.resnet(10, 10, image_size=32)
        folded = resnet.resnet(10, 10, image_size=32, space_to_depth=True)
        for layer in standard.layers:
            weights = layer.get_weights()
            if layer.name == 'stem_conv':
                weights = [resnet.space_to_depth_kernel(weights[0])]
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
        dataset = helpers.equivalence_batches(steps=4, batch=8, size=32).repeat()
        keras.utils.set_random_seed(0)
        initial = train.build_network(SMALL).get_weights()
        results = {}
        for jit, per_call in ((False, 1), (True, 1), (False, 4)):
            config = dataclasses.replace(SMALL, jit_compile=jit, steps_per_execution=per_call)
            results[(jit, per_call)] = helpers.train_from(config, initial, tf.distribute.get_strategy(), dataset, 4)
        reference = results[(False, 1)]
        self.assertGreater(max(np.abs(a - b).max() for a, b in zip(reference, initial)), 1e-3)
        for key, weights in results.items():
            for a, b in zip(reference, weights):
                self.assertAllClose(a, b, atol=1e-4, rtol=1e-3, msg=str(key))


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
        first = train.smoothed_cross_entropy(labels, network(images, training=False))
        self.assertTrue(np.isfinite(history.history['loss'][-1]))
        losses = []
        for _ in range(2):
            classifier.fit(tf.data.Dataset.from_tensors((images, labels)).repeat(), epochs=1, steps_per_epoch=15,
                           verbose=0)
            losses.append(float(tf.reduce_mean(train.smoothed_cross_entropy(labels, network(images, training=True)))))
        self.assertLess(losses[-1], float(tf.reduce_mean(first)))
        self.assertTrue(np.all(np.isfinite(losses)))

    def test_float16_uses_loss_scaling(self):
        optimizer = train.build_optimizer(dataclasses.replace(SMALL, precision='mixed_float16'))
        self.assertIsInstance(optimizer, keras.mixed_precision.LossScaleOptimizer)


if __name__ == '__main__':
    tf.test.main()
