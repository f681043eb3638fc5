"""The gradient noise scale of a run (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
arXiv:1812.06162): B_simple = tr(Sigma) / |G|^2, the batch size beyond which a larger batch stops shortening
training much, estimated from the two batch sizes every data-parallel step already has.

Each replica's gradient is that of a batch of b = global / replicas images; their all-reduced mean is that of the
global batch B. With |G_b|^2 the mean over replicas of each one's squared gradient norm and |G_B|^2 the squared
norm of the global gradient, the unbiased estimates of their appendix A are

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

Both are noisy step by step, so each is averaged over steps (an exponential moving average with ``decay``, bias
corrected, as the paper advises: the ratio of the averages, not the average of ratios) before the ratio is taken.
It needs at least two replicas (b < B), and replicas whose gradients are independent: with batch norm over groups
of replicas each replica's gradient depends on the others' images, which biases the estimate (builders.py refuses
that combination). Where the averaged |G|^2 estimate is not positive, B_simple is reported as NaN (not resolved);
a step with non-finite gradients is left out.
"""

import tensorflow as tf

DECAY = 0.99


def squared_norm(tensors) -> tf.Tensor:
    """Sum of squares of every element of ``tensors`` (None entries skipped), float32."""
    return tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors if t is not None])


class GradientNoiseScale(tf.Module):
    """Running estimates of |G|^2, tr(Sigma) and B_simple, updated once per step in replica context."""

    def __init__(self, decay: float = DECAY, name: str = 'gradient_noise_scale'):
        super().__init__(name=name)
        self.decay = decay
        kwargs = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        with tf.init_scope():
            self.squared_gradient = tf.Variable(0.0, name='squared_gradient', **kwargs)
            self.trace = tf.Variable(0.0, name='trace', **kwargs)
            self.steps = tf.Variable(0.0, name='steps', **kwargs)

    def update(self, replica_gradients, global_gradients, replica_batch: int, global_batch: int) -> dict:
        """Adds one step: ``replica_gradients``, this replica's gradient of the mean loss over its own
        ``replica_batch`` images; ``global_gradients``, the gradient of the mean loss over all ``global_batch``
        (the same on every replica). Returns {'noise_scale', 'squared_gradient', 'trace'} after the step (the
        smoothed estimates), the same on every replica."""
        small_batch, big_batch = float(replica_batch), float(global_batch)
        if not small_batch < big_batch:
            raise ValueError(f'the noise scale needs two batch sizes: a replica batch ({replica_batch}) smaller '
                             f'than the global batch ({global_batch}), so at least two replicas')
        context = tf.distribute.get_replica_context()
        small = context.all_reduce(tf.distribute.ReduceOp.MEAN, squared_norm(replica_gradients))
        big = squared_norm(global_gradients)
        squared_gradient = (big_batch * big - small_batch * small) / (big_batch - small_batch)
        trace = (small - big) / (1.0 / small_batch - 1.0 / big_batch)
        # A step whose gradients overflowed (mixed_float16 before the loss scale drops) adds nothing: averaged in,
        # its infinity would leave the estimates NaN for the rest of the run.
        finite = tf.math.is_finite(squared_gradient) & tf.math.is_finite(trace)
        decay = tf.where(finite, self.decay, 1.0)
        update = tf.where(finite, squared_gradient, 0.0)
        self.squared_gradient.assign(decay * self.squared_gradient + (1 - decay) * update)
        self.trace.assign(decay * self.trace + (1 - decay) * tf.where(finite, trace, 0.0))
        self.steps.assign_add(tf.where(finite, 1.0, 0.0))
        return self.result()

    def result(self) -> dict:
        correction = 1.0 - tf.pow(self.decay, tf.maximum(self.steps, 1.0))   # the averages' bias towards 0
        squared_gradient = self.squared_gradient / correction
        trace = self.trace / correction
        # The |G|^2 estimate is a difference of two noisy norms: where the true gradient is small beside its noise
        # (late in a run, with few replicas) its average can be 0 or negative, and B_simple is not resolved: NaN,
        # not a negative or huge batch size.
        unresolved = tf.constant(float('nan'), tf.float32)
        noise_scale = tf.where(squared_gradient > 0, trace / tf.maximum(squared_gradient, 1e-30), unresolved)
        return {'noise_scale': noise_scale, 'squared_gradient': squared_gradient, 'trace': trace}
