"""The Keras model that owns the training step: Classifier wraps the plain network (images -> logits) and adds
the loss (cross-entropy with label smoothing, averaged over the global batch, plus weight decay), the gradient
summation and the metrics that fit and evaluate report."""

from typing import Optional

import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.optim import regularization
from imagenet_tpu.optim.noise_scale import GradientNoiseScale


def smoothed_cross_entropy(labels: tf.Tensor, logits: tf.Tensor, label_smoothing: float = 0.0) -> tf.Tensor:
    """Per-example cross-entropy [batch] (float32) against one-hot labels smoothed towards uniform."""
    num_classes = logits.shape[-1]
    targets = tf.one_hot(labels, num_classes, dtype=tf.float32)
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
    return tf.nn.softmax_cross_entropy_with_logits(targets, tf.cast(logits, tf.float32))


class Classifier(keras.Model):
    """Owns the training step around ``network``; fit/evaluate report loss, top_1 and top_5.

    The loss of one replica is sum(cross-entropy) / global_batch_size + weight_decay_term / num_replicas, so
    that the gradients the optimizer sums over replicas are those of the mean loss over the global batch.
    """

    def __init__(self, network: keras.Model, *, global_batch_size: int, weight_decay: float = 0.0,
                 label_smoothing: float = 0.0, gradient_all_reduce=None, decayed=regularization.is_decayed,
                 noise_scale: Optional[GradientNoiseScale] = None, **kwargs):
        """gradient_all_reduce: optional callable(list of per-replica gradients) -> list of summed gradients,
        called in replica context (e.g. collectives.all_reduce_2d); the optimizer then applies the sums
        without aggregating again. Default: the optimizer's own all-reduce. decayed: callable(variable) -> bool,
        the variables weight_decay applies to (default: kernels only, regularization.is_decayed). noise_scale: a
        GradientNoiseScale updated at every step from the replicas' gradients and their sum (it then reports
        noise_scale among the step's outputs); not part of the model's checkpoints."""
        super().__init__(name=kwargs.pop('name', 'classifier'), **kwargs)
        self.network = network
        self.gradient_all_reduce = gradient_all_reduce
        self.global_batch_size = global_batch_size
        self.weight_decay = weight_decay
        self.label_smoothing = label_smoothing
        self.decayed = decayed
        self._self_setattr_tracking = False      # the estimator's running averages stay out of checkpoints
        self.noise_scale = noise_scale
        self._self_setattr_tracking = True
        self.loss_tracker = keras.metrics.Mean('loss')
        self.top_1 = keras.metrics.SparseCategoricalAccuracy('top_1')
        self.top_5 = keras.metrics.SparseTopKCategoricalAccuracy(5, 'top_5')

    @property
    def metrics(self):
        return [self.loss_tracker, self.top_1, self.top_5]

    def call(self, images, training=False):
        return self.network(images, training=training)

    def _update_metrics(self, labels, logits, per_example_loss, weights=None):
        self.loss_tracker.update_state(per_example_loss, sample_weight=weights)
        self.top_1.update_state(labels, logits, sample_weight=weights)
        self.top_5.update_state(labels, logits, sample_weight=weights)
        return {metric.name: metric.result() for metric in self.metrics}

    def train_step(self, data):
        images, labels, _ = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.network.trainable_variables
        loss_scaling = isinstance(self.optimizer, keras.mixed_precision.LossScaleOptimizer)
        with tf.GradientTape() as tape:
            logits = self.network(images, training=True)
            per_example_loss = smoothed_cross_entropy(labels, logits, self.label_smoothing)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=self.global_batch_size)
            penalty = regularization.l2_penalty(variables, self.weight_decay, self.decayed)
            loss += tf.nn.scale_regularization_loss(penalty)
            if loss_scaling:
                loss = self.optimizer.get_scaled_loss(loss)
        gradients = tape.gradient(loss, variables)
        if loss_scaling:
            gradients = self.optimizer.get_unscaled_gradients(gradients)
        noise = {}
        if self.gradient_all_reduce is None and self.noise_scale is None:
            self.optimizer.apply_gradients(zip(gradients, variables))
        else:
            local = gradients
            if self.gradient_all_reduce is None:
                gradients = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, gradients)
            else:
                gradients = self.gradient_all_reduce(gradients)
            if self.noise_scale is not None:
                # Each replica's loss is its images' cross-entropy over the global batch (plus its share of
                # weight decay): times the replica count, the gradient of its own mean loss.
                replicas = tf.distribute.get_replica_context().num_replicas_in_sync
                noise = self.noise_scale.update([g * float(replicas) for g in local], gradients,
                                                self.global_batch_size // replicas, self.global_batch_size)
            self.optimizer.apply_gradients(zip(gradients, variables), skip_gradients_aggregation=True)
        outputs = self._update_metrics(labels, logits, per_example_loss)
        if noise:
            outputs['noise_scale'] = noise['noise_scale']
        return outputs

    def test_step(self, data):
        """Evaluation batches may carry weights: 0 marks padding (see eval_input.eval_dataset)."""
        images, labels, weights = keras.utils.unpack_x_y_sample_weight(data)
        logits = self.network(images, training=False)
        per_example_loss = smoothed_cross_entropy(labels, logits, self.label_smoothing)
        return self._update_metrics(labels, logits, per_example_loss, weights)
