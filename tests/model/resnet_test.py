"""ResNet: parameter counts against torchvision's published table, block structure, zero-init gammas."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.data import preprocessing
from imagenet_tpu.model import resnet
from imagenet_tpu import builders

helpers.use_eight_cpus()

# torchvision.models.resnet{18,34,50,101}(num_classes=1000): same v1.5 network, no convolution biases.
PUBLISHED_PARAMETERS = {18: 11_689_512, 34: 21_797_672, 50: 25_557_032, 101: 44_549_160}


class ResNetTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(*sorted(PUBLISHED_PARAMETERS))
    def test_parameter_count_matches_published(self, depth):
        model = resnet.resnet(depth, 1000, image_size=64)
        # torchvision counts trainable parameters; batch-norm moving statistics are buffers there.
        trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        self.assertEqual(trainable, PUBLISHED_PARAMETERS[depth])

    def test_resnet10_is_resnet18_less_one_basic_block_per_stage(self):
        # Each stage of ResNet-18 repeats a basic block that keeps its width c: two 3x3 convolutions c -> c
        # (18 c^2 weights) and two batch norms (4 c); ResNet-10 has one block per stage.
        second_blocks = sum(18 * c * c + 4 * c for c in resnet.STAGE_WIDTHS)
        model = resnet.resnet(10, 1000, image_size=64)
        trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        self.assertEqual(trainable, PUBLISHED_PARAMETERS[18] - second_blocks)

    def test_resnet50_stride_on_3x3_convolution(self):
        # v1.5: in a downsampling bottleneck the 1x1 keeps the resolution and the 3x3 halves it.
        model = resnet.ResNet50(1000, image_size=64)
        conv1, conv2 = model.get_layer('stage2_block1_conv1'), model.get_layer('stage2_block1_conv2')
        self.assertEqual(conv1.strides, (1, 1))
        self.assertEqual(conv2.strides, (2, 2))
        self.assertEqual(conv2.kernel_size, (3, 3))

    def test_last_gamma_of_each_block_is_zero_so_blocks_start_as_identity(self):
        model = resnet.resnet(18, 10, image_size=32)
        last = [layer for layer in model.layers if layer.name.endswith('_bn2')]
        self.assertLen(last, 8)
        for layer in last:
            self.assertAllEqual(layer.gamma.numpy(), np.zeros_like(layer.gamma.numpy()))
        # With zero last gammas, a block whose input needs no projection outputs relu(input) = input
        # (its input is already a ReLU output).
        block_input = model.get_layer('stage1_block1_conv1').input
        block_output = model.get_layer('stage1_block1_out').output
        probe = keras.Model(model.input, [block_input, block_output])
        x, y = probe(np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32), training=False)
        self.assertAllClose(x, y)

    def test_forward_matches_keras_layers_run_by_hand(self):
        # The stem computed layer by layer with the model's own weights equals the model's intermediate output.
        model = resnet.resnet(18, 10, image_size=32)
        images = np.random.default_rng(1).normal(size=(2, 32, 32, 3)).astype(np.float32)
        kernel = model.get_layer('stem_conv').kernel.numpy()
        bn = model.get_layer('stem_bn')
        # The first layer standardizes pixels with ImageNet's channel statistics.
        standardized = (images - np.array(preprocessing.MEAN_RGB)) / np.array(preprocessing.STDDEV_RGB)
        conv = tf.nn.conv2d(standardized.astype(np.float32), kernel, strides=2, padding='SAME')
        normed = (conv - bn.moving_mean) / np.sqrt(bn.moving_variance + bn.epsilon) * bn.gamma + bn.beta
        expected = tf.nn.max_pool2d(tf.nn.relu(normed), 3, 2, 'SAME')
        probe = keras.Model(model.input, model.get_layer('stem_pool').output)
        self.assertAllClose(probe(images, training=False), expected, atol=1e-5)

    def test_unknown_depth_is_refused(self):
        with self.assertRaisesRegex(ValueError, 'unsupported ResNet depth 42'):
            resnet.resnet(42)


class SpaceToDepthStemTest(tf.test.TestCase):

    def test_the_stem_stays_a_7x7_stride_2_convolution_through_training(self):
        # LARS with weight decay, so nothing but the mask keeps the 8th row and column at zero.
        config = helpers.tiny_config(space_to_depth=True, image_size=32, optimizer='lars', learning_rate=5.0,
                                     weight_decay=1e-2, global_batch_size=8, num_train_images=24)
        classifier = builders.build_classifier(config)
        stem = classifier.network.get_layer('stem_conv')
        initial = stem.kernel.numpy().copy()
        rng = np.random.default_rng(0)
        images = helpers.pixels(rng, (24, 32, 32, 3))
        labels = rng.integers(0, 10, size=24).astype(np.int32)
        data = tf.data.Dataset.from_tensor_slices((tf.nn.space_to_depth(images, 2), labels)).batch(8)
        classifier.fit(data, epochs=1, verbose=0)
        kernel = stem.kernel.numpy()
        self.assertGreater(np.max(np.abs(kernel[:7, :7] - initial[:7, :7])), 1e-3)    # it trained
        self.assertAllEqual(kernel[7], np.zeros_like(kernel[7]))
        self.assertAllEqual(kernel[:, 7], np.zeros_like(kernel[:, 7]))
        # Reference: the 7x7 stride-2 SAME convolution of the standardized original images, by TensorFlow's op.
        standardized = (images - np.array(preprocessing.MEAN_RGB)) / np.array(preprocessing.STDDEV_RGB)
        expected = tf.nn.conv2d(standardized.astype(np.float32), kernel[:7, :7], strides=2, padding='SAME')
        network = classifier.network
        stem_output = keras.Model(network.input, stem.output)(tf.nn.space_to_depth(images, 2))
        self.assertAllClose(stem_output, expected, atol=1e-4, rtol=1e-4)

    def test_it_starts_with_the_7x7_kernels_scale(self):
        keras.utils.set_random_seed(3)
        folded = resnet.resnet(10, 10, image_size=64, space_to_depth=True).get_layer('stem_conv').kernel.numpy()
        standard = resnet.resnet(10, 10, image_size=64).get_layer('stem_conv').kernel.numpy()
        self.assertAllEqual(folded[7], np.zeros_like(folded[7]))
        self.assertAllEqual(folded[:, 7], np.zeros_like(folded[:, 7]))
        # VarianceScaling(2, fan_out) of a 7x7x3x64 kernel: after truncation the stddev is sqrt(2 / (7 * 7 * 64)).
        expected = np.sqrt(2.0 / (7 * 7 * 64))
        for kernel in (folded[:7, :7], standard):
            self.assertAllClose(np.std(kernel), expected, rtol=0.05)


if __name__ == '__main__':
    tf.test.main()
