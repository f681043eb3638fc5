"""Momentum SGD in one kernel per variable.

tf_keras's SGD (the optimizer of Keras 2.11 and later) writes its dense update as separate ops: for each variable
a negation, two products, a sum, an assignment of the momentum and an addition to the variable, six kernels and two
full passes over memory. TensorFlow has the same update as one kernel, ResourceApplyKerasMomentum (the one
tf_keras's legacy SGD calls, and tf-models-official's trainer with it), with CPU and GPU kernels and an XLA
lowering (tensorflow/core/kernels/training_ops.cc, tensorflow/compiler/tf2xla/kernels/training_ops.cc):

    m   <- momentum * m - lr * g
    var <- var + m                              (nesterov: var <- var + momentum * m - lr * g)

exactly tf_keras SGD's dense update. This class is tf_keras SGD with that kernel for dense gradients: the same
variables and slot names (checkpoints of either restore into the other), the same schedules and settings; sparse
gradients and SGD without momentum take tf_keras's path. One update of a ResNet-50's 25.6 M values took 23.4
against 48.9 ms on a 2-core CPU, and a whole ResNet-50 training step at 128 px 0.89x tf_keras SGD's time
(docs/benchmarks.md, D14 and D15).
"""

import tensorflow as tf
import tf_keras as keras


@keras.utils.register_keras_serializable('imagenet_tpu')
class SGD(keras.optimizers.SGD):
    """tf_keras.optimizers.SGD whose dense momentum update is one ResourceApplyKerasMomentum per variable."""

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices) or not self.momentum:
            return super().update_step(gradient, variable)
        momentum = self.momentums[self._index_dict[self._var_key(variable)]]
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle, accum=momentum.handle, lr=tf.cast(self.learning_rate, variable.dtype),
            grad=tf.cast(gradient, variable.dtype), momentum=tf.cast(self.momentum, variable.dtype),
            use_nesterov=self.nesterov)
