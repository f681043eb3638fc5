"""The rehearsal of a recipe: what it keeps and shrinks (against the recipe files themselves), the flags it
passes on, and, on simulated hosts, the demo recipe's whole rehearsal and one made to fail on purpose."""

import dataclasses
import os

from absl import flags
from absl.testing import parameterized
import pytest
import tensorflow as tf

import helpers
from imagenet_tpu import rehearse
from imagenet_tpu.commands import common
from imagenet_tpu.config import Config
from imagenet_tpu.plan import planner

RECIPES = ('demo', 'tpu_v3_8', 'gpu_8', 'tpu_v3_1024_bs32k', 'tpu_v3_4096_bs64k', 'gpu_1024_bs32k_akiba',
           'gpu_256_bs8k_goyal')


def recipe(name: str) -> Config:
    """The Config of a recipe file, as the command line reads it."""
    values = flags.FlagValues()
    common.define_flags(values)
    values(['rehearse', f'--flagfile={os.path.join(common.recipe_folder(), name + ".cfg")}'])
    return common.config_from_flags(values)


class ShrinkTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(*RECIPES)
    def test_what_is_kept_is_the_recipes_and_the_schedule_keeps_its_shape(self, name):
        original = recipe(name)
        shrunk, settings = rehearse.shrink(original)
        verdicts = {setting.name: setting.verdict for setting in settings}
        for kept in ('optimizer', 'lars_variant', 'precision', 'label_smoothing', 'weight_decay', 'momentum',
                     'bn_inference_statistics', 'allreduce', 'allreduce_dtype', 'space_to_depth', 'lr_decay',
                     'label_offset', 'nesterov', 'bn_momentum', 'bn_epsilon'):
            self.assertEqual(getattr(shrunk, kept), getattr(original, kept), kept)
            self.assertEqual(verdicts[kept], 'kept', kept)
        # The warm-up and the evaluation take the same share of the run (to a step and to an evaluation).
        recipe_epochs = original.train_steps * original.global_batch_size / original.num_train_images
        shrunk_epochs = shrunk.train_steps * shrunk.global_batch_size / shrunk.num_train_images
        self.assertAllClose(shrunk.warmup_epochs / shrunk_epochs, original.warmup_epochs / recipe_epochs)
        if original.lr_decay == 'step':
            self.assertAllClose([e / shrunk_epochs for e in shrunk.lr_decay_epochs],
                                [e / recipe_epochs for e in original.lr_decay_epochs])
        # The per-replica batch: the recipe's, up to MAX_PER_REPLICA; BN groups: what 4 replicas hold.
        per_replica = original.global_batch_size // rehearse.recipe_replicas(original)
        self.assertEqual(shrunk.global_batch_size // 4, min(per_replica, rehearse.MAX_PER_REPLICA))
        self.assertEqual(shrunk.bn_group_size_for(4), min(4, original.bn_group_size_for(
            rehearse.recipe_replicas(original))) if original.norm != 'none' else 1)
        self.assertEqual(verdicts['depth'], 'kept' if original.depth == rehearse.DEPTH else 'shrunk')

    def test_the_flags_passed_on_make_the_same_config(self):
        shrunk, _ = rehearse.shrink(recipe('tpu_v3_4096_bs64k'))
        values = flags.FlagValues()
        common.define_flags(values)
        values(['train', *rehearse.flag_arguments(shrunk)])
        self.assertEqual(common.config_from_flags(values), shrunk)

    def test_the_planner_counts_what_the_rehearsal_runs(self):
        shrunk, _ = rehearse.shrink(recipe('tpu_v3_1024_bs32k'))
        plan = planner.plan(dataclasses.replace(shrunk, topology='2x2xcpu'), cpu_peak_tflops=1.0)
        self.assertEqual((plan['replicas'], plan['input_pipelines'], plan['per_replica_batch']),
                         (4, 2, rehearse.MAX_PER_REPLICA))
        self.assertEqual(plan['steps_per_execution'], shrunk.steps_per_execution)


@pytest.mark.slow
class RehearsalTest(tf.test.TestCase):
    """A rehearsal made to fail on purpose names the phase and the run's own error line. (Whole rehearsals, the
    demo recipe's among them, are the second step of .ci/run, `make rehearse`: inside the suite they would take
    it past its 8 minutes.)"""

    def test_a_broken_setting_is_named(self):
        # XLA across the CPU replicas of one process is refused by the training command: the reference run
        # stops at once, and the report says where and why.
        broken = dataclasses.replace(recipe('demo'), jit_compile=True)
        report = rehearse.rehearse(broken, 'broken', os.path.join(helpers.class_folder(type(self)), 'broken'),
                                   workers=1, print_fn=lambda line: None)
        self.assertRegex(report['failed'], 'reference run: exit 2: .*jit_compile')
        self.assertEqual(list(report['phases']), ['data'])
        self.assertIn('FAILED: RehearsalError: reference run', rehearse.describe(report))


if __name__ == '__main__':
    tf.test.main()
