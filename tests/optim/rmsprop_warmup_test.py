"""RMSprop warm-up (Akiba et al. 2017) against NumPy implementations of its update, step by step: the source's form
while the learning rate is constant, ours (momentum in update units) when it changes, tf_keras SGD once it is SGD."""

import numpy as np
import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.optim import rmsprop_warmup
from imagenet_tpu.optim import schedules


def rmsprop_warmup_numpy(w, g, m, d, lr, alpha_sgd, eta_rms=3e-4, mu1=0.9, mu2=0.99, eps=1e-8):
    m = mu2 * m + (1 - mu2) * g ** 2
    alpha_rms = (1 - alpha_sgd) * eta_rms / lr
    d = mu1 * d - g * (alpha_sgd + alpha_rms / (np.sqrt(m) + eps))
    return w + lr * d, m, d


def rmsprop_warmup_update_units(w, g, m, v, lr, alpha_sgd, eta_rms=3e-4, mu1=0.9, mu2=0.99, eps=1e-8):
    m = mu2 * m + (1 - mu2) * g ** 2
    v = mu1 * v - g * (lr * alpha_sgd + (1 - alpha_sgd) * eta_rms / (np.sqrt(m) + eps))
    return w + v, m, v


class _Ramp(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warm-up from 0 to ``peak`` over ``steps``, then constant."""

    def __init__(self, steps, peak):
        self.steps, self.peak = steps, peak

    def __call__(self, step):
        return self.peak * tf.minimum(tf.cast(step, tf.float32) / self.steps, 1.0)

    def get_config(self):
        return {'steps': self.steps, 'peak': self.peak}


class RMSpropWarmupTest(tf.test.TestCase):

    def test_steps_match_numpy_across_the_blend(self):
        rng = np.random.default_rng(1)
        w0 = rng.normal(size=(5,)).astype(np.float64)
        variable = tf.Variable(w0)
        alpha = schedules.AlphaSGD(center_steps=3, period_steps=4)   # 0.11, 0.18, 0.30, 0.5, 0.75, 1, 1
        optimizer = rmsprop_warmup.RMSpropWarmup(0.1, alpha, rms_learning_rate=3e-3)
        w, m, d = w0, np.zeros(5), np.zeros(5)
        for step in range(7):
            g = rng.normal(size=(5,))
            optimizer.apply_gradients([(tf.constant(g), variable)])
            a = 0.5 * np.exp(2 * (step - 3) / 4) if step < 3 else min(1.0, 0.5 + (step - 3) / 4)
            w, m, d = rmsprop_warmup_numpy(w, g, m, d, 0.1, a, eta_rms=3e-3)
            self.assertAllClose(variable, w, rtol=1e-6)

    def test_a_learning_rate_from_zero_stays_finite_and_matches_numpy(self):
        # A linear warm-up from 0: the source's form divides by eta = 0 at step 0 (alpha_rms about 3e8 here) and
        # its weights blow up within a few steps; ours matches its NumPy reference and stays of the size of RMSprop's.
        rng = np.random.default_rng(3)
        w0 = rng.normal(size=(6,))
        variable = tf.Variable(w0)
        warmup = _Ramp(10, 1.0)
        alpha = schedules.AlphaSGD(center_steps=4, period_steps=4)
        optimizer = rmsprop_warmup.RMSpropWarmup(warmup, alpha)
        w, m, v = w0, np.zeros(6), np.zeros(6)
        w_source, m_source, d_source = w0, np.zeros(6), np.zeros(6)
        for step in range(8):
            g = rng.normal(size=(6,))
            optimizer.apply_gradients([(tf.constant(g), variable)])
            lr = min(step / 10, 1.0)
            a = 0.5 * np.exp(2 * (step - 4) / 4) if step < 4 else min(1.0, 0.5 + (step - 4) / 4)
            w, m, v = rmsprop_warmup_update_units(w, g, m, v, lr, a)
            with np.errstate(divide='ignore', invalid='ignore'):
                w_source, m_source, d_source = rmsprop_warmup_numpy(w_source, g, m_source, d_source, max(lr, 1e-12),
                                                                    a)
            self.assertAllClose(variable, w, rtol=1e-6)
        self.assertLess(np.max(np.abs(w - w0)), 5.0)
        self.assertGreater(np.max(np.abs(w_source - w0)), 1e6)

    def test_equals_momentum_sgd_once_alpha_sgd_is_one(self):
        rng = np.random.default_rng(2)
        w0 = rng.normal(size=(4, 3)).astype(np.float32)
        ours, reference = tf.Variable(w0), tf.Variable(w0)
        warm = rmsprop_warmup.RMSpropWarmup(_Ramp(4, 0.05), schedules.AlphaSGD(-100, 10), momentum=0.9)
        sgd = keras.optimizers.SGD(_Ramp(4, 0.05), momentum=0.9)
        for _ in range(7):
            g = tf.constant(rng.normal(size=(4, 3)).astype(np.float32))
            warm.apply_gradients([(g, ours)])
            sgd.apply_gradients([(g, reference)])
        self.assertAllClose(ours, reference, rtol=1e-5, atol=1e-6)


if __name__ == '__main__':
    tf.test.main()
