"""What one image costs the network, counted from the Keras model training builds: multiply-adds of the forward
pass, parameters, and the activations the backward pass keeps."""

import math
from typing import NamedTuple

import tf_keras as keras


class NetworkCosts(NamedTuple):
    """Per image: ``forward_macs`` (multiply-adds of convolutions and dense layers), ``activations`` (elements of
    every layer's output, what training keeps for the backward pass); of the whole network: ``parameters`` (the
    trainable ones: gradients and optimizer slots) and ``variables`` (all, with batch-norm statistics)."""
    forward_macs: int
    parameters: int
    variables: int
    activations: int

    @property
    def training_flops(self) -> float:
        """FLOPs of one training image: the forward pass and two as large backward (input and weight gradients),
        2 FLOPs per multiply-add."""
        return 3 * 2 * self.forward_macs


def _per_image(shape) -> int:
    return math.prod(int(d) for d in shape[1:])


def count(network: keras.Model) -> NetworkCosts:
    """NetworkCosts of ``network`` (any Keras functional model of convolutions and dense layers)."""
    macs = activations = 0
    for layer in network.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        outputs = layer.output if isinstance(layer.output, (list, tuple)) else [layer.output]
        activations += sum(_per_image(output.shape) for output in outputs)
        kernel = getattr(layer, 'kernel', None)
        if kernel is None:
            continue
        if len(kernel.shape) == 4:            # convolution: output pixels x filters x (kh * kw * input channels)
            height, width, _, filters = kernel.shape
            inputs_per_output = height * width * kernel.shape[2] // getattr(layer, 'groups', 1)
            macs += _per_image(outputs[0].shape) * inputs_per_output
        elif len(kernel.shape) == 2:          # dense
            macs += _per_image(outputs[0].shape) * kernel.shape[0]
    trainable = sum(math.prod(variable.shape) for variable in network.trainable_variables)
    return NetworkCosts(macs, int(trainable), int(network.count_params()), activations)
