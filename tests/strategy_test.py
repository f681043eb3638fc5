"""Strategies: a TPU or GPU strategy where there is none is a one-line ConfigError naming the fix (the real TPU
attempt runs in a process of its own: main_test)."""

import tensorflow as tf

from imagenet_tpu import strategy
from imagenet_tpu.config import ConfigError


class StrategyTest(tf.test.TestCase):

    def test_tpu_messages_name_the_fix_for_each_kind_of_failure(self):
        no_kernel = tf.errors.NotFoundError(None, None, "TPUs not found in the cluster. Failed in initialization: "
                                                        "No OpKernel was registered to support Op "
                                                        "'ConfigureDistributedTPU'\nRegistered devices: [CPU]")
        message = strategy.tpu_unreachable_message('local', no_kernel)
        self.assertIn('install tensorflow-tpu', message)
        self.assertIn('--strategy=cpu', message)
        self.assertNotIn('\n', message)
        message = strategy.tpu_unreachable_message('my-pod', OSError('Name or service not known'))
        self.assertIn("no TPU named 'my-pod' answers", message)
        self.assertIn('Name or service not known', message)
        message = strategy.tpu_unreachable_message('local', RuntimeError('x' * 500))
        self.assertLess(len(message), 400)

    def test_mirrored_strategy_without_gpus(self):
        if tf.config.list_physical_devices('GPU'):
            self.skipTest('this machine has GPUs')
        with self.assertRaisesRegex(ConfigError, "needs GPUs and none is visible; use --strategy=cpu"):
            strategy.make_strategy('mirrored')

    def test_tpu_strategy_needs_a_name(self):
        with self.assertRaisesRegex(ConfigError, "needs --tpu=NAME"):
            strategy.make_strategy('tpu')


if __name__ == '__main__':
    tf.test.main()
