"""Learning-rate schedules against closed forms and the published recipes' numbers."""

import numpy as np
import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.optim import schedules
from imagenet_tpu import builders
from imagenet_tpu.config import Config


class ScheduleTest(tf.test.TestCase):

    def test_step_decay_against_closed_form(self):
        rate = schedules.WarmupStepDecay(3.2, 10, [30, 60, 80])
        for step, expected in ((0, 0.0), (5, 1.6), (10, 3.2), (29, 3.2), (30, 0.32), (60, 0.032), (85, 0.0032)):
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_polynomial_decay_against_closed_form(self):
        rate = schedules.WarmupPolynomialDecay(31.2, 100, 1100, end=1e-4, power=2)
        for step in (0, 50, 100, 350, 600, 1099, 1100, 2000):
            if step < 100:
                expected = 31.2 * step / 100
            else:
                t = min(1.0, (step - 100) / 1000)
                expected = 1e-4 + (31.2 - 1e-4) * (1 - t) ** 2
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_mlperf_v06_recipe_schedule(self):
        # Batch 32768: 25 warm-up epochs = 25 * 1281167 / 32768 = 977.4 -> 977 steps; 2983 steps in all.
        config = Config(global_batch_size=32768, total_steps=2983, learning_rate=31.2, warmup_epochs=25,
                        lr_decay='polynomial', end_learning_rate=1e-4, polynomial_power=2)
        rate = builders.build_learning_rate(config)
        table = {0: 0.0, 488: 31.2 * 488 / 977, 977: 31.2, 1980: 1e-4 + (31.2 - 1e-4) * (1 - 1003 / 2006) ** 2,
                 2983: 1e-4}
        for step, expected in table.items():
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_slow_start_boundaries(self):
        # Akiba et al., batch 32768: eta = 0.1 * 128 = 12.8; epochs 40/70/85 = 1563.9/2736.9/3323.3 -> 1564/2737/3323.
        config = Config(global_batch_size=32768, base_learning_rate=0.1, lr_decay='slow_start', warmup_epochs=0)
        rate = builders.build_learning_rate(config)
        table = {0: 6.4, 1563: 6.4, 1564: 0.96, 2736: 0.96, 2737: 0.128, 3322: 0.128, 3323: 0.0128, 3500: 0.0128}
        for step, expected in table.items():
            self.assertAllClose(rate(step), expected, rtol=1e-5)

    def test_alpha_sgd_blend(self):
        alpha = schedules.AlphaSGD(center_steps=100, period_steps=50)
        table = {0: 0.5 * np.exp(-4.0), 50: 0.5 * np.exp(-2.0), 99: 0.5 * np.exp(-2 / 50), 100: 0.5, 110: 0.7,
                 125: 1.0, 500: 1.0}
        for step, expected in table.items():
            self.assertAllClose(alpha(step), expected, rtol=1e-5)

    def test_cosine_and_serialization(self):
        rate = schedules.WarmupCosineDecay(1.0, 0, 100)
        self.assertAllClose([rate(s) for s in (0, 50, 100)], [1.0, 0.5, 0.0], atol=1e-6)
        restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(rate))
        self.assertIsInstance(restored, schedules.WarmupCosineDecay)
        self.assertAllClose(restored(25), rate(25))


if __name__ == '__main__':
    tf.test.main()
