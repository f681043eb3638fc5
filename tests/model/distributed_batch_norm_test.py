"""Replica-group batch norm inside training: settings, 1 device vs 8 replicas, Akiba and re-estimated statistics,
SavedModel."""

import dataclasses
import os
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.model import batch_norm
from imagenet_tpu.training import checkpoints
from imagenet_tpu.model import classifier as classifier_lib
from imagenet_tpu.data import eval_input, input_pipeline
from imagenet_tpu.model import resnet
from imagenet_tpu import train
from imagenet_tpu import builders
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

    def test_synchronized_groups_on_4_replicas_equal_one_device(self):
        # On one device a group is the whole batch; with group = all 4 replicas, each batch norm sees the same
        # 16 images, so the two runs must agree (weights, batch-norm parameters and moving statistics). 4
        # replicas rather than 8: tracing the grouped collectives is most of this test's time.
        norm = batch_norm.group_batch_norm_factory(group_size=4, momentum=0.9, epsilon=1e-5)

        def classifier():
            network = resnet.resnet(10, 10, image_size=16, norm=norm)
            classifier = classifier_lib.Classifier(network, global_batch_size=16, weight_decay=1e-4)
            classifier.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
            return classifier

        keras.utils.set_random_seed(0)
        initial = resnet.resnet(10, 10, image_size=16, norm=norm).get_weights()
        initial, (single, multi) = helpers.train_same_start(
            [(classifier, tf.distribute.get_strategy()), (classifier, helpers.mirrored(4))], initial=initial)
        helpers.assert_same_training(self, single, multi, initial, atol=2e-5, rtol=2e-4, min_change=1e-3)


@pytest.mark.slow
class TrainWithGroupsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'data')
        helpers.write_dataset(self.data_dir, num_classes=10)
        # Each test a model directory of its own: a run resumes from the checkpoints it finds there.
        model_dir = os.path.join(self.get_temp_dir(), 'run_' + self.id().rsplit('.', 1)[1])
        self.config = helpers.tiny_config(data_dir=self.data_dir, norm='batch_norm', shuffle_buffer=8,
                                          log_every_steps=0, bn_group_size=2, export_saved_model=True,
                                          model_dir=model_dir)

    def _images(self):
        batches = [b for b in eval_input.eval_dataset(self.config)]
        return np.concatenate([b[0] for b in batches])[:20], np.concatenate([b[1] for b in batches])[:20]

    def test_reestimated_statistics_in_a_run_its_evaluation_checkpoint_and_export(self):
        # 4 replicas in groups of 2 (replicas 0-1 and 2-3; tracing a ResNet step with collectives costs ~1 min per
        # 8 replicas here); before each evaluation the moving statistics are recomputed from 2 training batches.
        # Each re-estimation is recorded: the batches it read, the weights it saw and the statistics it set.
        # (The statistics of the last batch, the other setting, are tested on the layer: model/batch_norm_test.py.)
        config = dataclasses.replace(self.config, bn_inference_statistics='reestimate', bn_reestimate_batches=2)
        strategy = helpers.mirrored(4)
        recorded = []
        reestimate = batch_norm.reestimate_statistics

        def recording(network, batches, steps, strategy=None):
            taken = [next(batches) for _ in range(steps)]
            weights = network.get_weights()
            reestimate(network, iter(taken), steps, strategy)
            statistics = {layer.name: (layer.moving_mean.numpy(), layer.moving_variance.numpy())
                          for layer in network.submodules if isinstance(layer, keras.layers.BatchNormalization)}
            recorded.append((taken, weights, statistics))

        with mock.patch.object(batch_norm, 'reestimate_statistics', recording):
            results = train.train_and_evaluate(config, strategy, print_fn=lambda line: None)
        self.assertEqual(results['eval_images'], 20)
        self.assertNotEmpty(recorded)
        taken, weights, statistics = recorded[-1]     # the one before the final evaluation

        # Reference: the same network with Keras's own batch norm on one device. Run in training mode on the
        # concatenated batches of one group, it normalizes every layer's input as that group's replicas did;
        # NumPy then pools each layer's input over every group of every batch.
        reference = resnet.resnet(10, 10, image_size=16, norm=resnet.batch_norm_factory(0.9, 1e-5))
        reference.set_weights(weights)
        layers = [layer for layer in reference.layers if isinstance(layer, keras.layers.BatchNormalization)]
        self.assertCountEqual([layer.name for layer in layers], statistics)
        probe = keras.Model(reference.input, [layer.input for layer in layers])
        inputs = [[] for _ in layers]
        for images, _ in taken:
            replicas = [x.numpy() for x in strategy.experimental_local_results(images)]
            self.assertEqual([len(x) for x in replicas], [4, 4, 4, 4])
            for group in (replicas[0:2], replicas[2:4]):
                for pooled, x in zip(inputs, probe(np.concatenate(group), training=True)):
                    pooled.append(x.numpy().astype(np.float64))
        expected = {}
        for layer, pooled in zip(layers, inputs):
            values = np.concatenate(pooled).reshape(-1, layer.moving_mean.shape[0])    # 2 batches x 16 images
            expected[layer.name] = values.mean(0), values.var(0)
            mean, variance = statistics[layer.name]
            # (Measured: 3e-7 apart; pooled over other groups, e.g. replicas 0 and 2, they are 0.06 or more apart.)
            self.assertAllClose(mean, expected[layer.name][0], atol=1e-5, rtol=1e-4, msg=layer.name)
            self.assertAllClose(variance, expected[layer.name][1], atol=1e-5, rtol=1e-4, msg=layer.name)

        # The evaluation used those statistics: top-1 and loss of the reference network with them, on one device.
        for layer in layers:
            layer.moving_mean.assign(expected[layer.name][0])
            layer.moving_variance.assign(expected[layer.name][1])
        images, labels = self._images()
        logits = reference(images, training=False)
        loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=config.label_smoothing)(
            tf.one_hot(labels, 10), logits)
        self.assertAllClose(results['loss'], loss, rtol=1e-4)
        self.assertAllClose(results['top_1'], np.mean(np.argmax(logits, -1) == labels))
        self.assertEqual(results['eval_images'], 20)

        # The export holds them too, and so does the last checkpoint: the distributed model restored from it and
        # run on the 4 replicas gives the export's logits.
        loaded = tf.saved_model.load(os.path.join(config.model_dir, 'saved_model'))
        exported_logits = loaded.signatures['serving_preprocessed'](images=tf.constant(images))['logits'].numpy()
        self.assertAllClose(exported_logits, logits, atol=1e-4, rtol=1e-4)
        with strategy.scope():
            restored = builders.build_classifier(config)
        checkpoints.restore_latest(checkpoints.checkpoint_manager(restored, config.model_dir))
        per_replica = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(images[:16]))
        # (from_tensors of 16 images: each of the 4 replicas gets 4)
        outputs = strategy.run(lambda x: restored.network(x, training=False), args=(next(iter(per_replica)),))
        distributed_logits = np.concatenate([o.numpy() for o in strategy.experimental_local_results(outputs)])
        self.assertAllClose(exported_logits[:16], distributed_logits, atol=1e-4, rtol=1e-4)


if __name__ == '__main__':
    tf.test.main()
