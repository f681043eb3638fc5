"""Which variables get weight decay: the one place that states the exclusion rule.

Batch-norm parameters (gamma, beta) and biases are excluded; convolution and dense kernels are decayed. Every
excluded variable is a vector and every decayed one has rank >= 2, so the rule is the rank: it does not depend
on layer names, which users rename.
"""

import tensorflow as tf


def is_decayed(variable: tf.Variable) -> bool:
    """True for kernels (rank >= 2), False for batch-norm parameters and biases (rank <= 1)."""
    return len(variable.shape) >= 2


def l2_penalty(variables, weight_decay: float, decayed=is_decayed) -> tf.Tensor:
    """weight_decay / 2 * sum of squared decayed weights (so its gradient is weight_decay * w), float32.
    ``decayed``: which variables (default: is_decayed)."""
    decayed = [tf.cast(v, tf.float32) for v in variables if decayed(v)]
    if not decayed or not weight_decay:
        return tf.constant(0.0)
    return weight_decay * tf.add_n([tf.nn.l2_loss(v) for v in decayed])
