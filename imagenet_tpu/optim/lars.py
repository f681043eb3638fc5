"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional
Networks", arXiv 1708.03888), with the update of the MLPerf ResNet TPU submissions and TensorFlow contrib.

For each variable w with gradient g (MLPerf / contrib, the default):

    trust = eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)      (trust = 1 if ||w|| = 0 or ||g|| = 0)
    v     <- momentum * v + learning_rate * trust * (g + weight_decay * w)
    w     <- w - v                                   (Nesterov: w <- w - (momentum * v + lr * trust * (g + wd * w)))

Variables matched by the exclusion rule (default: batch-norm parameters and biases, see regularization.py) get
neither weight decay nor the trust ratio: v <- momentum * v + learning_rate * g.

This is TensorFlow 1.15's tf.contrib.opt.LARSOptimizer, which MLPerf v0.7's Google submission called
(lars_util.py lines 107-112 of Google/benchmarks/resnet/implementations/resnet-research-TF-tpu-v3-8192/,
mlcommons/training_results_v0.7, with the loss free of weight decay: resnet_main.py lines 255-256).

``variant='mlperf_v0.6'`` is the rule MLPerf v0.6's Google submission ran: TensorFlow 1.14's LARSOptimizer (its
setup.sh pins tf-nightly 1.14.1.dev20190518; lars_util.py lines 109-114 of .../tpu-v3-1024-resnet/resnet/,
mlcommons/training_results_v0.6) with weight decay also in the loss (resnet_main.py lines 391-393). The
gradient g it receives then already holds the decay, the learning rate stays outside the accumulator, and
weight_decay only enters the trust ratio's denominator:

    trust = eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)      (same zero guards; 1 for excluded ones)
    v     <- momentum * v + g
    w     <- w - learning_rate * trust * v              (Nesterov: w <- w - learning_rate * trust * (g + momentum * v))

Train it with the decay in the loss, on every variable but the batch-norm parameters (builders.py does this).

``variant='tfm'`` selects tf-models-official's rule, for users porting its hyperparameters: the decay is
added first, g' = g + weight_decay * w, then trust = eeta * ||w|| / ||g'|| (same zero guards, no epsilon) and
v <- momentum * v + learning_rate * trust * g'.

With 'mlperf' and 'tfm' weight decay is part of this update: train with it here and not also in the loss.
"""

from typing import Callable, Optional

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.optim import regularization

VARIANTS = ('mlperf', 'mlperf_v0.6', 'tfm')


def default_exclusion(variable: tf.Variable) -> bool:
    """True for variables that get neither weight decay nor the trust ratio: batch-norm parameters, biases."""
    return not regularization.is_decayed(variable)


@keras.utils.register_keras_serializable('imagenet_tpu')
class LARS(keras.optimizers.Optimizer):
    """Momentum SGD with a per-variable trust ratio (see the module docstring for the exact update).

    Args:
      learning_rate: float or LearningRateSchedule; the MLPerf recipes peak at 24.7-31.2 for batch 32k-64k.
        Default 1.0.
      momentum: float, default 0.9.
      weight_decay: L2 coefficient, default 1e-4: applied inside the update ('mlperf', 'tfm'), or only in the
        trust ratio's denominator ('mlperf_v0.6', whose decay is in the loss).
      eeta: trust coefficient, default 0.001 (MLPerf).
      epsilon: added to the trust ratio's denominator, default 0.0 (MLPerf v0.6 used 1e-5, v0.7 0).
      nesterov: Nesterov momentum, default False.
      variant: 'mlperf' (default: MLPerf v0.7, TF 1.15 contrib), 'mlperf_v0.6' (TF 1.14 contrib) or 'tfm'
        (tf-models-official's).
      exclude: callable(variable) -> bool; True means no weight decay and no trust ratio. Default:
        batch-norm parameters and biases (rank <= 1). Not serialized by get_config.
      name, **kwargs: as for every Keras optimizer (e.g. global_clipnorm, jit_compile).
    """

    def __init__(self, learning_rate=1.0, momentum: float = 0.9, weight_decay: float = 1e-4, eeta: float = 0.001,
                 epsilon: float = 0.0, nesterov: bool = False, variant: str = 'mlperf',
                 exclude: Optional[Callable[[tf.Variable], bool]] = None, name: str = 'LARS', **kwargs):
        super().__init__(name=name, **kwargs)
        if variant not in VARIANTS:
            raise ValueError(f'variant must be one of {VARIANTS}, got {variant!r}')
        self._learning_rate = self._build_learning_rate(learning_rate)
        # Not `self.weight_decay`: the Keras base class would apply that a second time, decoupled, every step.
        self.momentum, self.weight_decay_rate, self.eeta = momentum, weight_decay, eeta
        self.epsilon, self.nesterov, self.variant = epsilon, nesterov, variant
        self.exclude = exclude or default_exclusion

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, '_built', False):
            return
        self._built = True
        self.velocities = [self.add_variable_from_reference(v, 'velocity') for v in var_list]
        # Decided once per variable, in Python: the step itself has no per-variable host work.
        self._excluded = {self._var_key(v): bool(self.exclude(v)) for v in var_list}

    def _trust(self, w_norm, g_norm, denominator):
        ratio = self.eeta * w_norm / denominator
        return tf.where(tf.logical_and(w_norm > 0, g_norm > 0), ratio, tf.ones_like(ratio))

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)
        lr = tf.cast(self.learning_rate, variable.dtype)
        momentum = tf.cast(self.momentum, variable.dtype)
        velocity = self.velocities[self._index_dict[self._var_key(variable)]]
        if self.variant == 'mlperf_v0.6':
            self._update_v06(gradient, variable, velocity, lr, momentum)
            return
        if self._excluded[self._var_key(variable)]:
            scaled = lr * gradient
        else:
            decayed = gradient + self.weight_decay_rate * variable
            w_norm, g_norm = tf.norm(variable), tf.norm(gradient)
            if self.variant == 'mlperf':
                trust = self._trust(w_norm, g_norm, g_norm + self.weight_decay_rate * w_norm + self.epsilon)
            else:
                decayed_norm = tf.norm(decayed)
                trust = self._trust(w_norm, decayed_norm, decayed_norm)
            scaled = lr * trust * decayed
        velocity.assign(momentum * velocity + scaled)
        if self.nesterov:
            variable.assign_sub(momentum * velocity + scaled)
        else:
            variable.assign_sub(velocity)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter(self._learning_rate), momentum=self.momentum,
                      weight_decay=self.weight_decay_rate, eeta=self.eeta, epsilon=self.epsilon, nesterov=self.nesterov,
                      variant=self.variant)
        return config

    def _update_v06(self, gradient, variable, velocity, lr, momentum):
        """TensorFlow 1.14's rule: the learning rate times the trust ratio scales the accumulated raw gradients."""
        if self._excluded[self._var_key(variable)]:
            scaled_lr = lr
        else:
            w_norm, g_norm = tf.norm(variable), tf.norm(gradient)
            scaled_lr = lr * self._trust(w_norm, g_norm, g_norm + self.weight_decay_rate * w_norm + self.epsilon)
        velocity.assign(momentum * velocity + gradient)
        if self.nesterov:
            variable.assign_sub(scaled_lr * (gradient + momentum * velocity))
        else:
            variable.assign_sub(scaled_lr * velocity)
