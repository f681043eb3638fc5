"""The planner: its arithmetic against hand-worked cases, its counts against training's own derivations of them,
its network counts against the published ResNet-50 figures, and its predictions against every published MLPerf
ResNet-50 result it holds (plan/published.py, read from mlcommons/training_results_v0.6 ... v4.0)."""

import contextlib
import dataclasses
import io
import json
import os
import statistics

from absl import flags
from absl.testing import flagsaver, parameterized
import tensorflow as tf

import helpers
from imagenet_tpu.commands import common
from imagenet_tpu.commands import plan as plan_command
from imagenet_tpu.config import Config, ConfigError
from imagenet_tpu.model import resnet
from imagenet_tpu.plan import costs, model, planner, published

RECIPE_64K = os.path.join(helpers.REPO, 'flags', 'tpu_v3_4096_bs64k.cfg')


def recipe(path, **overrides) -> Config:
    with flagsaver.flagsaver():
        flags.FLAGS(['imagenet-tpu-plan', f'--flagfile={path}'])
        return dataclasses.replace(common.config_from_flags(), **overrides)


class CostModelTest(tf.test.TestCase):

    def test_all_reduce_formulas_by_hand(self):
        # 4 chips, 8 MB in 1 bucket, 1 us per hop, 1 GB/s: ring 2*3 hops, torus 2x2: 2*(1+1) hops; bandwidth term
        # 2 * 3/4 * 8e6 / 1e9 = 12 ms for both.
        self.assertAlmostEqual(model.ring_seconds(4, 8e6, 1, 1e-6, 1e9), 6e-6 + 0.012)
        self.assertAlmostEqual(model.torus_seconds((2, 2), 8e6, 1, 1e-6, 1e9), 4e-6 + 0.012)
        self.assertAlmostEqual(model.torus_seconds((4, 4, 4), 0.0, 2, 1e-6, 1e9), 2 * 2 * 9 * 1e-6)
        self.assertEqual(model.torus_shape(4096, 3), (16, 16, 16))
        self.assertEqual(model.torus_shape(512, 2), (32, 16))

    def test_epochs_from_the_reference_points(self):
        # Between 13,056 (45.4 epochs) and 32,768 (56.0): 45.4 + 3,328 / 19,712 * 10.6 = 47.1896.
        self.assertAlmostEqual(model.epochs_to_accuracy(16384)[0], 47.1896, places=4)
        self.assertEqual(model.epochs_to_accuracy(65536), (84.5, True))
        self.assertEqual(model.epochs_to_accuracy(1024), (35.0, False))
        self.assertEqual(model.epochs_to_accuracy(131072), (85.857, False))

    def test_resnet50_counts_are_the_published_ones(self):
        # ResNet-50 v1.5 at 224: 4.09 GMAC forward, 25,557,032 trainable parameters (tf-models-official's and
        # torchvision's tables).
        counted = costs.count(resnet.resnet(50, 1000, image_size=224))
        self.assertAlmostEqual(counted.forward_macs / 1e9, 4.09, delta=0.005)
        self.assertEqual(counted.parameters, 25_557_032)
        self.assertGreater(counted.variables, counted.parameters)


class PublishedRunsTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.counted = costs.count(resnet.resnet(50, 1000, image_size=224))

    def test_predictions_meet_the_target_on_runs_not_used_for_calibration(self):
        errors = [published.predict_minutes(run, self.counted) / run.minutes - 1 for run in published.RUNS
                  if (run.round, run.system) not in published.CALIBRATION]
        self.assertGreaterEqual(len(errors), 50)
        self.assertLessEqual(statistics.median(abs(error) for error in errors), 0.20)
        self.assertLessEqual(max(abs(error) for error in errors), 0.40)

    def test_the_calibrated_terms_are_the_fit_of_the_two_calibration_runs(self):
        self.assertLen(published.calibration_runs(), 2)
        efficiency, overhead = published.fit(self.counted)
        self.assertAlmostEqual(efficiency, model.COMPUTE_EFFICIENCY, delta=0.003)
        self.assertAlmostEqual(overhead, model.STEP_OVERHEAD_SECONDS, delta=6e-5)
        for run in published.calibration_runs():
            self.assertAllClose(published.predict_minutes(run, self.counted), run.minutes, rtol=0.03)


class PlannerTest(tf.test.TestCase, parameterized.TestCase):

    def test_the_64k_recipe_on_v3_8192_by_hand(self):
        config = recipe(RECIPE_64K, topology='v3-8192', tpu='pod')
        result = planner.plan(config, to_accuracy=0.759)
        # 4,096 chips x 2 cores; 1,024 hosts of 4 chips; 65,536 / 8,192 = 8 per replica; groups of 8 = 64 images.
        self.assertEqual((result['replicas'], result['hosts'], result['per_replica_batch']), (8192, 1024, 8))
        self.assertEqual((result['bn_group_replicas'], result['bn_group_images']), (8, 64))
        # 1,738 steps of 65,536 = 88.9 epochs; Keras epochs of round(1,281,167 / 65,536) = 20 steps: 87 of them,
        # an evaluation after every 4th (21) and the final one; 50,000 / 1,024 hosts = 49 images a host, 1 step.
        self.assertEqual(result['steps'], 1738)
        self.assertAlmostEqual(result['epochs'], 1738 * 65536 / 1281167)
        self.assertEqual((result['evaluations'], result['eval_steps']), (22, 1))
        self.assertEqual(result['epochs_to_accuracy'], 84.5)
        for key in ('replicas', 'hosts', 'per_replica_batch', 'bn_group_images', 'step_seconds', 'images_per_second',
                    'epochs', 'minutes_to_train', 'memory_gib_per_replica', 'hbm_gib',
                    'input_images_per_second_per_host'):
            self.assertIn(key, result)
        self.assertAllClose(result['images_per_second'], 65536 / result['step_seconds'])
        self.assertAllClose(result['minutes_to_train'],
                            (result['epochs'] * 1281167 / result['images_per_second']
                             + 22 * result['evaluation_seconds']) / 60)

    def test_counts_are_training_s_own(self):
        config = recipe(RECIPE_64K, topology='v3-8192', tpu='pod', eval_every_epochs=3, train_epochs=10.5,
                        total_steps=None)
        result = planner.plan(config)
        from imagenet_tpu import builders
        from imagenet_tpu.training import loop
        self.assertEqual(result['steps'], config.train_steps)
        self.assertEqual(result['evaluations'], loop.planned_evaluations(config))
        self.assertEqual(result['steps_per_execution'], builders.default_steps_per_execution(config, True))

    def test_the_largest_batch_that_fits_is_the_last_that_fits(self):
        config = recipe(RECIPE_64K, topology='v3-8192', tpu='pod')
        largest = planner.plan(config)['largest_per_replica_batch']
        fits = planner.plan(dataclasses.replace(config, global_batch_size=largest * 8192, eval_batch_size=8192,
                                                bn_group_size=1))
        over = planner.plan(dataclasses.replace(config, global_batch_size=(largest + 1) * 8192,
                                                eval_batch_size=8192, bn_group_size=1))
        self.assertTrue(fits['fits'])
        self.assertFalse(over['fits'])

    @parameterized.parameters(
        (dict(topology='v9-8'), 'must name a TPU slice'),
        (dict(topology='8xB200'), 'must name a TPU slice'),
        (dict(topology='v3-8', global_batch_size=1001), 'global_batch_size=1001 is not divisible by the 8'),
        (dict(topology='v3-8', bn_group_size=16), 'group of 16 replicas does not divide the 8 replicas'),
        (dict(topology=''), '--topology is not set'),
    )
    def test_what_cannot_run_there_is_one_line(self, overrides, message):
        base = dict(depth=18, image_size=64, global_batch_size=1024, strategy='default')
        with self.assertRaisesRegex(ConfigError, message) as caught:
            planner.plan(Config(**{**base, **overrides}))
        self.assertNotIn('\n', str(caught.exception))

    def test_command_prints_json_and_draws_the_scaling_picture(self):
        picture = os.path.join(self.get_temp_dir(), 'scaling.png')
        stdout = io.StringIO()
        with flagsaver.flagsaver(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            plan_command.main(flags.FLAGS(['imagenet-tpu-plan', f'--flagfile={RECIPE_64K}', '--topology=v4-128',
                                           '--tpu=pod', '--json', f'--scaling={picture}', '--to_accuracy=0.759']))
        result = json.loads(stdout.getvalue())
        self.assertEqual((result['chips'], result['replicas'], result['hosts']), (64, 64, 16))
        self.assertEqual(result['per_replica_batch'], 1024)
        self.assertFalse(result['fits'])      # 1,024 images per v4 chip do not fit in 32 GiB
        with open(picture, 'rb') as f:
            self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')


if __name__ == '__main__':
    tf.test.main()
