"""Checkpointing: fit segments of a resumed run, the model-settings check, checkpoints that do not fit."""

import dataclasses
import os

import tensorflow as tf

import helpers
from imagenet_tpu.training import checkpoints
from imagenet_tpu.training import run_folder
from imagenet_tpu.training import loop
from imagenet_tpu import errors
from imagenet_tpu import builders


class FitSegmentsTest(tf.test.TestCase):

    def test_fresh_run_is_one_segment(self):
        self.assertEqual(loop.fit_segments(0, 30, 10), [loop.FitSegment(0, 3, 10)])

    def test_resume_mid_epoch_finishes_that_epoch_first(self):
        self.assertEqual(loop.fit_segments(14, 30, 10),
                         [loop.FitSegment(1, 2, 6), loop.FitSegment(2, 3, 10)])

    def test_fractional_last_epoch_and_finished_run(self):
        self.assertEqual(loop.fit_segments(0, 25, 10),
                         [loop.FitSegment(0, 2, 10), loop.FitSegment(2, 3, 5)])
        self.assertEqual(loop.fit_segments(25, 25, 10), [])


class ModelSettingsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.config = helpers.tiny_config(norm='batch_norm', num_classes=10,
                                          model_dir=os.path.join(self.get_temp_dir(), 'run'))

    def test_resuming_a_different_model_is_refused_by_name(self):
        run_folder.ensure_writable(self.config.model_dir)
        run_folder.record_run(self.config)
        other = dataclasses.replace(self.config, depth=34, num_classes=5)
        run_folder.check_model_settings(other, self.config.model_dir)   # no checkpoint yet: nothing binds it
        os.makedirs(os.path.join(self.config.model_dir, 'checkpoints'))
        open(os.path.join(self.config.model_dir, 'checkpoints', 'ckpt-3.index'), 'w').close()
        with self.assertRaisesRegex(errors.CheckpointError, r"different model \(depth=10 there, 34 now; "
                                                 r"num_classes=10 there, 5 now\)"):
            run_folder.check_model_settings(other, self.config.model_dir)
        run_folder.check_model_settings(self.config, self.config.model_dir)   # the same model passes

    def test_checkpoint_that_does_not_fit_is_a_clear_error(self):
        small = dataclasses.replace(self.config, num_classes=10)
        classifier = builders.build_classifier(small)
        manager = checkpoints.checkpoint_manager(classifier, self.config.model_dir)
        manager.save(checkpoint_number=1)
        other = builders.build_classifier(dataclasses.replace(small, num_classes=7))
        with self.assertRaisesRegex(errors.CheckpointError, 'ckpt-1 does not fit this model'):
            checkpoints.restore_latest(checkpoints.checkpoint_manager(other, self.config.model_dir))


if __name__ == '__main__':
    tf.test.main()
