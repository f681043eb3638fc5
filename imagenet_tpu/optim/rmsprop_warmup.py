"""RMSprop warm-up (Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD", arXiv 1711.04325).

Early in training the update is mostly RMSprop, which copes with the large, uneven gradients of a fresh network at
batch 32k; it then hands over to momentum SGD. With g the gradient, eta the learning rate and t the step, the paper
(and the ChainerMN code the recipe cites: crest-deep/dlframeworks, chainer/examples/imagenet/rmsprop_warmup/
rmsprop_warmup.py, lines 82-86, at commit d113fb7) writes

    m     <- mu2 * m + (1 - mu2) * g^2
    d     <- mu1 * d - g * (alpha_sgd(t) + alpha_rms(t) / (sqrt(m) + epsilon))
    theta <- theta + eta * d
    alpha_rms(t) = (1 - alpha_sgd(t)) * eta_rms / eta

so eta * alpha_rms = (1 - alpha_sgd) * eta_rms: the RMSprop part moves at rate eta_rms, whatever the SGD schedule.
That form divides by eta and keeps d in units of 1 / eta: where eta is 0 or near it (a linear warm-up from 0, which
the source does not have: its eta is piecewise constant and never 0), d stores eta_rms / eta, about 1e8 times too
large, and the next step multiplies it by a non-zero eta; the weights become NaN within a few steps. Ours keeps the
momentum in update units, v = eta * d, and never divides by eta:

    v     <- mu1 * v - g * (eta(t) * alpha_sgd(t) + (1 - alpha_sgd(t)) * eta_rms / (sqrt(m) + epsilon))
    theta <- theta + v

While eta has been constant since step 0 this is the source's update exactly (the source's eta stays at 0.5 x its
base for the first 40 of 90 epochs, long after alpha_sgd reaches 1 at 12.5); where eta changes, the momentum carries
the earlier rates as tf_keras SGD's does (Goyal et al. 2017's form without their "momentum correction"; the
source's form applies it). alpha_sgd is schedules.AlphaSGD (1/2 exp(2 (t - center) / period) before the centre,
then linear to 1 at center + period / 2). No bias correction of m, as in the paper's formula. Once alpha_sgd = 1
the update is exactly tf_keras SGD with momentum mu1, for any schedule of eta.

Weight decay is not part of this update; it stays in the loss (train.Classifier).
"""

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.optim import schedules


@keras.utils.register_keras_serializable('imagenet_tpu')
class RMSpropWarmup(keras.optimizers.Optimizer):
    """Args:
      learning_rate: eta, float or LearningRateSchedule (Akiba et al.: the slow-start schedule).
      alpha_sgd: schedules.AlphaSGD (or any step -> [0, 1] schedule).
      rms_learning_rate: eta_rms, default 3e-4.
      momentum: mu1, default 0.9.  rho: mu2, default 0.99.  epsilon: default 1e-8.
    """

    def __init__(self, learning_rate=0.1, alpha_sgd=None, rms_learning_rate: float = 3e-4, momentum: float = 0.9,
                 rho: float = 0.99, epsilon: float = 1e-8, name: str = 'RMSpropWarmup', **kwargs):
        super().__init__(name=name, **kwargs)
        self._learning_rate = self._build_learning_rate(learning_rate)
        if isinstance(alpha_sgd, dict):
            alpha_sgd = keras.optimizers.schedules.deserialize(alpha_sgd)
        self.alpha_sgd = alpha_sgd or schedules.AlphaSGD(0, 1)
        self.rms_learning_rate, self.momentum, self.rho, self.epsilon = rms_learning_rate, momentum, rho, epsilon

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, '_built', False):
            return
        self._built = True
        self.mean_squares = [self.add_variable_from_reference(v, 'mean_square') for v in var_list]
        self.velocities = [self.add_variable_from_reference(v, 'velocity') for v in var_list]

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)
        dtype = variable.dtype
        index = self._index_dict[self._var_key(variable)]
        mean_square, velocity = self.mean_squares[index], self.velocities[index]
        lr = tf.cast(self.learning_rate, dtype)
        alpha_sgd = tf.cast(self.alpha_sgd(self.iterations), dtype)
        mean_square.assign(self.rho * mean_square + (1 - self.rho) * tf.square(gradient))
        rate = lr * alpha_sgd + (1 - alpha_sgd) * self.rms_learning_rate / (tf.sqrt(mean_square) + self.epsilon)
        velocity.assign(self.momentum * velocity - gradient * rate)
        variable.assign_add(velocity)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter(self._learning_rate),
                      alpha_sgd=keras.optimizers.schedules.serialize(self.alpha_sgd),
                      rms_learning_rate=self.rms_learning_rate, momentum=self.momentum, rho=self.rho,
                      epsilon=self.epsilon)
        return config
