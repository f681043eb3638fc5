"""RMSprop warm-up (Akiba, Suzuki, Fukuda 2017, "Extremely Large Minibatch SGD", arXiv 1711.04325).

Early in training the update is mostly RMSprop, which copes with the large, uneven gradients of a fresh network at
batch 32k; it then hands over to momentum SGD. With g the gradient, eta the learning rate and t the step:

    m     <- mu2 * m + (1 - mu2) * g^2
    d     <- mu1 * d - g * (alpha_sgd(t) + alpha_rms(t) / (sqrt(m) + epsilon))
    theta <- theta + eta * d
    alpha_rms(t) = (1 - alpha_sgd(t)) * eta_rms / eta

so eta * alpha_rms = (1 - alpha_sgd) * eta_rms: the RMSprop part always moves at rate eta_rms, whatever the SGD
schedule. alpha_sgd is schedules.AlphaSGD (1/2 exp(2 (t - center) / period) before the centre, then linear to 1 at
center + period / 2). No bias correction of m, as in the paper's formula. Once alpha_sgd = 1 the update is exactly
momentum SGD, theta <- theta + eta * d with d <- mu1 * d - g (for a constant eta, the same as tf_keras SGD).

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
        self.directions = [self.add_variable_from_reference(v, 'direction') for v in var_list]

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)
        dtype = variable.dtype
        index = self._index_dict[self._var_key(variable)]
        mean_square, direction = self.mean_squares[index], self.directions[index]
        lr = tf.cast(self.learning_rate, dtype)
        alpha_sgd = tf.cast(self.alpha_sgd(self.iterations), dtype)
        alpha_rms = (1 - alpha_sgd) * self.rms_learning_rate / tf.maximum(lr, 1e-12)
        mean_square.assign(self.rho * mean_square + (1 - self.rho) * tf.square(gradient))
        direction.assign(self.momentum * direction
                         - gradient * (alpha_sgd + alpha_rms / (tf.sqrt(mean_square) + self.epsilon)))
        variable.assign_add(lr * direction)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter(self._learning_rate),
                      alpha_sgd=keras.optimizers.schedules.serialize(self.alpha_sgd),
                      rms_learning_rate=self.rms_learning_rate, momentum=self.momentum, rho=self.rho,
                      epsilon=self.epsilon)
        return config
