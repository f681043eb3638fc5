"""Kernels for machines without GPU or TPU, chosen by measurement: the seam between the model and the CPU.

The model asks for ``BatchNormalization``, ``ReLU`` and ``Conv2D`` here: Keras's layers, with the same variables and
checkpoints, whose computations are faster formulations only where no GPU or TPU runs them (batch_norm.cpu_only),
each chosen by timing it on the machine (tune_network, before training) and kept per machine (tuning.py).
"""

from imagenet_tpu.cpu import batch_norm, convolution
from imagenet_tpu.cpu.batch_norm import BatchNormalization, ReLU, cpu_only
from imagenet_tpu.cpu.convolution import Conv2D

__all__ = ['BatchNormalization', 'Conv2D', 'ReLU', 'cpu_only', 'tune_network']


def tune_network(network, batch_size: int, num_replicas: int = 1) -> dict:
    """Times the convolutions' and the batch norms' formulations of ``network`` for batches of ``batch_size`` per
    replica now, before any replica runs: {'convolution': {Problem: choice}, 'batch_norm': {shape: formulation}}."""
    return {'convolution': convolution.tune_network(network, batch_size, num_replicas),
            'batch_norm': batch_norm.tune_network(network, batch_size)}
