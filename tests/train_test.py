"""train_and_evaluate: resume at the saved step, divergence, an input that ends early, replicas that do not
divide the batch, and the settings the command line used to apply alone (seed, synthetic data)."""

import dataclasses
import os
import re
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu.training import checkpoints
from imagenet_tpu.training import loop
from imagenet_tpu import errors
from imagenet_tpu.data import eval_input, input_pipeline
from imagenet_tpu import train
from imagenet_tpu import builders
from imagenet_tpu.config import ConfigError

helpers.use_eight_cpus()

TINY = helpers.tiny_config()


class BuildersTest(tf.test.TestCase):

    def test_lars_v06_decays_every_variable_but_batch_norm_in_the_loss(self):
        # MLPerf v0.6's resnet_main.py (lines 391-393): loss = cross_entropy + weight_decay * sum of l2_loss(v)
        # over every trainable variable whose name lacks 'batch_normalization', also under LARS.
        config = helpers.tiny_config(norm='batch_norm', optimizer='lars', lars_variant='mlperf_v0.6',
                                     weight_decay=1e-3)
        classifier = builders.build_classifier(config)
        variables = classifier.network.trainable_variables
        self.assertEqual(classifier.weight_decay, 1e-3)
        self.assertEqual([v.name for v in variables if classifier.decayed(v)],
                         [v.name for v in variables if not v.name.endswith(('gamma:0', 'beta:0'))])
        self.assertIn('logits/bias:0', [v.name for v in variables if classifier.decayed(v)])
        for variant in ('mlperf', 'tfm'):    # these decay inside the update, never in the loss
            other = builders.build_classifier(dataclasses.replace(config, lars_variant=variant))
            self.assertEqual(other.weight_decay, 0.0)
        momentum = builders.build_classifier(dataclasses.replace(config, optimizer='sgd'))
        self.assertEqual([v.name for v in variables if momentum.decayed(v)],
                         [v.name for v in variables if v.name.endswith('kernel:0')])


class TrainAndEvaluateTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.data_dir = os.path.join(self.get_temp_dir(), 'data')
        helpers.write_dataset(self.data_dir, num_classes=10)
        self.config = dataclasses.replace(TINY, data_dir=self.data_dir, norm='batch_norm', num_classes=10,
                                          model_dir=os.path.join(self.get_temp_dir(), 'run'),
                                          checkpoint_every_steps=2, log_every_steps=0, shuffle_buffer=8)

    @pytest.mark.slow
    def test_resume_continues_at_the_saved_step(self):
        lines = []
        strategy = helpers.mirrored(2)
        # 2 of an epoch's 3 steps, as if the run had stopped mid-epoch.
        first = train.train_and_evaluate(dataclasses.replace(self.config, train_epochs=2 / 3), strategy,
                                         print_fn=lines.append)
        self.assertEqual(first['steps'], 2)
        with strategy.scope():
            saved = builders.build_classifier(self.config)
        manager = checkpoints.checkpoint_manager(saved, self.config.model_dir)
        self.assertTrue(manager.latest_checkpoint.endswith('ckpt-2'), manager.latest_checkpoint)
        checkpoints.restore_latest(manager)
        self.assertEqual(int(saved.optimizer.iterations.numpy()), 2)

        lines.clear()
        second = train.train_and_evaluate(dataclasses.replace(self.config, train_epochs=2), strategy,
                                          print_fn=lines.append)
        self.assertIn(f'resumed from {manager.latest_checkpoint} at step 2', lines)
        self.assertEqual(second['steps'], 6)  # 2 + the rest of epoch 1 (1) + epoch 2 (3), not 2 + 6
        self.assertEqual(second['eval_images'], 20)  # every held-out image, the last batch partial
        self.assertTrue(os.path.exists(os.path.join(self.config.model_dir, 'results.json')))

    def test_synthetic_data_is_a_setting(self):
        config = dataclasses.replace(self.config, synthetic_data=True, data_dir=None, model_dir=None)
        results = train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)
        self.assertEqual(results['steps'], 3)
        self.assertNotIn('top_1', results)            # no evaluation without data

    @pytest.mark.slow
    def test_in_run_evaluation_uses_the_statistics_the_export_holds(self):
        # 4 replicas of 4 images with per-replica batch norm: each replica's moving statistics differ, and a
        # checkpoint or export holds their mean. Reference: the exported SavedModel, loaded without this package,
        # on the same held-out images, its loss and top-1 computed with NumPy.
        config = dataclasses.replace(self.config, export_saved_model=True, train_epochs=1, label_smoothing=0.1,
                                     model_dir=os.path.join(self.get_temp_dir(), 'exported'))
        results = train.train_and_evaluate(config, helpers.mirrored(4), print_fn=lambda line: None)
        served = tf.saved_model.load(os.path.join(config.model_dir, 'saved_model')).signatures['serving_preprocessed']
        losses, correct = [], []
        for images, labels, weights in eval_input.eval_dataset(config):
            logits = served(images=images)['logits'].numpy().astype(np.float64)
            keep = weights.numpy() == 1
            logits, labels = logits[keep], labels.numpy()[keep]
            log_probabilities = logits - logits.max(1, keepdims=True)
            log_probabilities -= np.log(np.exp(log_probabilities).sum(1, keepdims=True))
            targets = np.eye(config.num_classes)[labels] * (1 - 0.1) + 0.1 / config.num_classes
            losses.extend(-(targets * log_probabilities).sum(1))
            correct.extend(logits.argmax(1) == labels)
        self.assertLen(losses, 20)
        # The epoch's validation was of the final weights: it is the run's evaluation, not repeated after it.
        self.assertEqual((results['evaluations'], loop.planned_evaluations(config)), (1, 1))
        self.assertAllClose(results['loss'], np.mean(losses), rtol=1e-5)
        self.assertAlmostEqual(results['top_1'], np.mean(correct), places=6)

    def test_non_finite_loss_stops_without_saving_that_step(self):
        config = dataclasses.replace(self.config, base_learning_rate=1e30, norm='none', checkpoint_every_steps=1,
                                     train_epochs=2)
        with self.assertRaisesRegex(errors.TrainingDiverged, r'training loss is (nan|inf) at step (\d+)') as caught:
            train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)
        step = int(caught.exception.args[0].split('at step ')[1].split(';')[0])
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), os.path.join(config.model_dir, 'checkpoints'), 3)
        saved = [int(path.rsplit('-', 1)[1]) for path in manager.checkpoints]
        self.assertNotIn(step, saved)
        self.assertTrue(all(s < step for s in saved))

    def test_with_several_steps_per_call_a_divergence_names_the_calls_steps(self):
        # Keras calls back once per host call (3 steps here, an epoch): the step that diverged is one of them.
        config = dataclasses.replace(self.config, base_learning_rate=1e30, norm='none', checkpoint_every_steps=3,
                                     train_epochs=2, steps_per_execution=3)
        with self.assertRaisesRegex(errors.TrainingDiverged, r'(nan|inf) in steps (\d+)-(\d+);') as caught:
            train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)
        first, last = (int(step) for step in re.search(r'in steps (\d+)-(\d+);', caught.exception.args[0]).groups())
        self.assertEqual((last - first + 1, last % 3), (3, 0))
        self.assertNotRegex(caught.exception.args[0], 'at step')

    def test_input_that_ends_early_stops_the_run_instead_of_shortening_it(self):
        # Keras ends a fit call quietly when its input ends; the training stream is endless, so an end means an
        # input error that the distributed iterator reported as the end of the data. 4 per-replica batches are
        # 2 steps on 2 replicas; with none at all Keras raises its own "Empty logs" error. (The step counter is
        # no proof: with no data at all it was seen at 1, and in one CI run it reached the planned 3.)
        original = input_pipeline.train_dataset
        for steps in (4, 0):
            message = r'input ended early \(this fit call was to reach step 3; the step counter is at \d\)'
            config = dataclasses.replace(self.config, model_dir=os.path.join(self.get_temp_dir(), f'ended{steps}'))
            with mock.patch.object(input_pipeline, 'train_dataset',
                                   lambda *args, **kwargs: original(*args, **kwargs).take(steps)):
                with self.assertRaisesRegex(errors.InputEnded, message):
                    train.train_and_evaluate(config, helpers.mirrored(2), print_fn=lambda line: None)



    def test_global_batch_not_divisible_by_replicas(self):
        config = dataclasses.replace(self.config, global_batch_size=12)
        with self.assertRaisesRegex(ConfigError, 'global_batch_size=12 is not divisible by the 8 replicas'):
            train.train_and_evaluate(config, helpers.mirrored(8))


if __name__ == '__main__':
    tf.test.main()
