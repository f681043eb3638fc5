"""Weight decay: on convolution and dense kernels only, never on batch-norm parameters or biases."""

import numpy as np
import tensorflow as tf
import tf_keras as keras

from imagenet_tpu.optim import regularization


class WeightDecayTest(tf.test.TestCase):

    def test_weight_decay_skips_batch_norm_and_biases(self):
        model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Conv2D(2, 3, use_bias=True),
                                  keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(3)])
        decayed = {v.name for v in model.trainable_variables if regularization.is_decayed(v)}
        self.assertEqual({name.split('/')[-1].split(':')[0] for name in decayed}, {'kernel'})
        self.assertLen(decayed, 2)
        expected = 1e-3 / 2 * sum(np.sum(v.numpy() ** 2) for v in model.trainable_variables if 'kernel' in v.name)
        self.assertAllClose(regularization.l2_penalty(model.trainable_variables, 1e-3), expected, rtol=1e-6)


if __name__ == '__main__':
    tf.test.main()
