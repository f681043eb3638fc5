"""train_and_evaluate: resume at the saved step, divergence, an input that ends early, replicas that do not
divide the batch, and the settings the command line used to apply alone (seed, synthetic data)."""

import dataclasses
import os
from unittest import mock

import pytest
import tensorflow as tf

import helpers
from imagenet_tpu import checkpointing, errors, input_pipeline, train
from imagenet_tpu.config import ConfigError

helpers.use_eight_cpus()

TINY = helpers.tiny_config()


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
        strategy = helpers.mirrored(8)
        # 2 of an epoch's 3 steps, as if the run had stopped mid-epoch.
        first = train.train_and_evaluate(dataclasses.replace(self.config, train_epochs=2 / 3), strategy,
                                         print_fn=lines.append)
        self.assertEqual(first['steps'], 2)
        with strategy.scope():
            saved = train.build_classifier(self.config)
        manager = checkpointing.checkpoint_manager(saved, self.config.model_dir)
        self.assertTrue(manager.latest_checkpoint.endswith('ckpt-2'), manager.latest_checkpoint)
        checkpointing.restore_latest(manager)
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
