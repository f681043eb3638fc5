"""Learning-rate schedules driven by the optimizer's step, each a serializable Keras LearningRateSchedule.

All ramp linearly from 0 to the peak over ``warmup_steps`` (the rate at step s of the warm-up is
peak * s / warmup_steps), then decay. Steps per epoch come from the dataset size and the global batch
(Config.steps_per_epoch); the classes themselves only see steps.
"""

import math
from typing import Sequence

import tensorflow as tf
import tf_keras as keras


def _warmup(step, peak: float, warmup_steps: int):
    return peak * step / max(1, warmup_steps)


@keras.utils.register_keras_serializable('imagenet_tpu')
class WarmupStepDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then the peak multiplied by ``decay_factor`` at each of ``boundaries`` (Goyal et al.)."""

    def __init__(self, peak: float, warmup_steps: int, boundaries: Sequence[int], decay_factor: float = 0.1):
        self.peak, self.warmup_steps, self.decay_factor = peak, int(warmup_steps), decay_factor
        self.boundaries = [int(b) for b in boundaries]

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        decays = tf.add_n([tf.cast(step >= b, tf.float32) for b in self.boundaries]) if self.boundaries else 0.0
        decayed = self.peak * tf.pow(self.decay_factor, decays)
        return tf.where(step < self.warmup_steps, _warmup(step, self.peak, self.warmup_steps), decayed)

    def get_config(self):
        return dict(peak=self.peak, warmup_steps=self.warmup_steps, boundaries=self.boundaries,
                    decay_factor=self.decay_factor)


@keras.utils.register_keras_serializable('imagenet_tpu')
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then end + (peak - end) * (1 - t)^power with t going 0 -> 1 from the warm-up's end to
    ``total_steps`` (MLPerf ResNet: power 2, end 1e-4); ``end`` after that."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, end: float = 1e-4, power: float = 2.0):
        self.peak, self.warmup_steps, self.total_steps = peak, int(warmup_steps), int(total_steps)
        self.end, self.power = end, power

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        progress = tf.clip_by_value(progress, 0.0, 1.0)
        decayed = self.end + (self.peak - self.end) * tf.pow(1.0 - progress, self.power)
        return tf.where(step < self.warmup_steps, _warmup(step, self.peak, self.warmup_steps), decayed)

    def get_config(self):
        return dict(peak=self.peak, warmup_steps=self.warmup_steps, total_steps=self.total_steps, end=self.end,
                    power=self.power)


@keras.utils.register_keras_serializable('imagenet_tpu')
class WarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then peak * (1 + cos(pi * t)) / 2 with t going 0 -> 1 until ``total_steps``."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int):
        self.peak, self.warmup_steps, self.total_steps = peak, int(warmup_steps), int(total_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        progress = tf.clip_by_value(
            (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps), 0.0, 1.0)
        decayed = self.peak * 0.5 * (1.0 + tf.cos(math.pi * progress))
        return tf.where(step < self.warmup_steps, _warmup(step, self.peak, self.warmup_steps), decayed)

    def get_config(self):
        return dict(peak=self.peak, warmup_steps=self.warmup_steps, total_steps=self.total_steps)


@keras.utils.register_keras_serializable('imagenet_tpu')
class PiecewiseConstantEpochs(keras.optimizers.schedules.LearningRateSchedule):
    """peak * multipliers[i] between boundaries[i-1] and boundaries[i] (in steps); Akiba et al.'s slow start is
    multipliers (0.5, 0.075, 0.01, 0.001) at epochs (40, 70, 85) of 90."""

    def __init__(self, peak: float, boundaries: Sequence[int], multipliers: Sequence[float]):
        if len(multipliers) != len(boundaries) + 1:
            raise ValueError('need one more multiplier than boundaries')
        self.peak, self.boundaries, self.multipliers = peak, [int(b) for b in boundaries], list(multipliers)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        index = tf.add_n([tf.cast(step >= b, tf.int32) for b in self.boundaries]) if self.boundaries else 0
        return self.peak * tf.gather(tf.constant(self.multipliers, tf.float32), index)

    def get_config(self):
        return dict(peak=self.peak, boundaries=self.boundaries, multipliers=self.multipliers)


SLOW_START_EPOCHS = (40.0, 70.0, 85.0)
SLOW_START_MULTIPLIERS = (0.5, 0.075, 0.01, 0.001)


@keras.utils.register_keras_serializable('imagenet_tpu')
class AlphaSGD(keras.optimizers.schedules.LearningRateSchedule):
    """Akiba et al.'s blend from RMSprop to SGD, alpha_sgd(t) in [0, 1], t in steps:

        alpha_sgd = 1/2 * exp(2 (t - center) / period)        for t < center
        alpha_sgd = min(1, 1/2 + (t - center) / period)        for t >= center

    The two pieces meet at t = center with the same value (1/2) and slope (1/period), so the blend is smooth;
    it reaches pure SGD at center + period / 2. Akiba et al.: center 10 epochs, period 5 epochs. Their formula,
    as transcribed by others, has slope 2 / period after the centre, which passes 1 before center + period / 2
    (the boundary it states); this smooth reading is ours.
    """

    def __init__(self, center_steps: float, period_steps: float):
        self.center_steps, self.period_steps = float(center_steps), float(max(period_steps, 1e-9))

    def __call__(self, step):
        t = (tf.cast(step, tf.float32) - self.center_steps) / self.period_steps
        return tf.where(t < 0, 0.5 * tf.exp(2.0 * tf.minimum(t, 0.0)), tf.minimum(1.0, 0.5 + t))

    def get_config(self):
        return dict(center_steps=self.center_steps, period_steps=self.period_steps)
