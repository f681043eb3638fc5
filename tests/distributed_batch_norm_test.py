"""Replica-group batch norm inside training: settings, 1 device vs 8 replicas, Akiba statistics, SavedModel."""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu import batch_norm, input_pipeline, resnet, train
from imagenet_tpu.config import Config, ConfigError

helpers.use_eight_cpus()


class GroupSizeSettingTest(tf.test.TestCase):

    def test_span_sets_the_group_size(self):
        # 64 images per batch norm with 8 per replica (global 256 on 32 replicas) -> groups of 8.
        self.assertEqual(Config(global_batch_size=256, bn_span=64).bn_group_size_for(32), 8)
        self.assertEqual(Config(global_batch_size=256, bn_group_size=4).bn_group_size_for(32), 4)

    def test_bad_groups_are_clear_errors(self):
        with self.assertRaisesRegex(ConfigError, 'group of 3 replicas does not divide the 8 replicas'):
            Config(global_batch_size=64, bn_group_size=3).bn_group_size_for(8)
        with self.assertRaisesRegex(ConfigError, 'bn_span=20 is not a multiple of the per-replica batch 8'):
            Config(global_batch_size=64, bn_span=20).bn_group_size_for(8)


@pytest.mark.slow
class SynchronizedTrainingTest(tf.test.TestCase):

    def test_synchronized_groups_on_8_replicas_equal_one_device(self):
        # On one device a group is the whole batch; with group = all 8 replicas, each batch norm sees the same
        # 16 images, so the two runs must agree (weights, batch-norm parameters and moving statistics).
        rng = np.random.default_rng(0)
        images = helpers.pixels(rng, (48, 16, 16, 3))
        labels = rng.integers(0, 10, size=48).astype(np.int32)
        dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(16)
        norm = batch_norm.group_batch_norm_factory(group_size=8, momentum=0.9, epsilon=1e-5)
        keras.utils.set_random_seed(0)
        initial = resnet.resnet(10, 10, image_size=16, norm=norm).get_weights()

        def run(strategy):
            with strategy.scope():
                network = resnet.resnet(10, 10, image_size=16, norm=norm)
                network.set_weights(initial)
                classifier = train.Classifier(network, global_batch_size=16, weight_decay=1e-4)
                classifier.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
            classifier.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
            return network.get_weights()

        single, multi = run(tf.distribute.get_strategy()), run(helpers.mirrored(8))
        self.assertGreater(max(np.abs(a - b).max() for a, b in zip(single, initial)), 1e-3)
        for a, b in zip(single, multi):
            self.assertAllClose(a, b, atol=2e-5, rtol=2e-4)


@pytest.mark.slow
class TrainWithGroupsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'data')
        helpers.write_dataset(self.data_dir, num_classes=10)
        self.config = Config(data_dir=self.data_dir, depth=10, num_classes=10, image_size=16, global_batch_size=16,
                             eval_batch_size=16, num_train_images=48, num_eval_images=20, train_epochs=1,
                             warmup_epochs=0, lr_decay='cosine', base_learning_rate=0.4, shuffle_buffer=8,
                             log_every_steps=0, bn_group_size=2, export_saved_model=True,
                             model_dir=os.path.join(self.get_temp_dir(), 'run'))

    def _images(self):
        batches = [b for b in input_pipeline.eval_dataset(self.config)]
        return np.concatenate([b[0] for b in batches])[:20], np.concatenate([b[1] for b in batches])[:20]

    def test_last_batch_statistics_export_and_single_device_inference(self):
        # 4 replicas in groups of 2 (tracing a ResNet step with collectives costs ~1 min per 8 replicas here).
        config = dataclasses.replace(self.config, bn_inference_statistics='last_batch')
        strategy = helpers.mirrored(4)
        results = train.train_and_evaluate(config, strategy, print_fn=lambda line: None)
        loaded = tf.saved_model.load(os.path.join(config.model_dir, 'saved_model'))
        images, labels = self._images()
        exported_logits = loaded.signatures['serving_default'](images=tf.constant(images))['logits'].numpy()
        # The distributed model, restored from the last checkpoint and run on 8 replicas.
        with strategy.scope():
            restored = train.build_classifier(config)
        train.restore_latest(train.checkpoint_manager(restored, config.model_dir))
        per_replica = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(images[:16]))
        # (from_tensors of 16 images: each of the 4 replicas gets 4)
        outputs = strategy.run(lambda x: restored.network(x, training=False), args=(next(iter(per_replica)),))
        distributed_logits = np.concatenate([o.numpy() for o in strategy.experimental_local_results(outputs)])
        self.assertAllClose(exported_logits[:16], distributed_logits, atol=1e-4, rtol=1e-4)
        # Evaluation during training used the same statistics: same top-1 over the 20 held-out images.
        self.assertAllClose(np.mean(exported_logits.argmax(-1) == labels), results['top_1'])
        self.assertEqual(results['eval_images'], 20)

    def test_reestimated_statistics_in_a_run(self):
        config = dataclasses.replace(self.config, bn_inference_statistics='reestimate', bn_reestimate_batches=2,
                                     export_saved_model=False)
        results = train.train_and_evaluate(config, helpers.mirrored(4), print_fn=lambda line: None)
        self.assertEqual(results['eval_images'], 20)
        self.assertTrue(np.isfinite(results['loss']))


if __name__ == '__main__':
    tf.test.main()
