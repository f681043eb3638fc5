"""Kernels for machines without GPU or TPU, chosen by measurement: the seam between the model and the CPU.

The model asks for ``BatchNormalization`` and ``Conv2D`` here: Keras's layers, with the same variables and
checkpoints, whose computations are faster formulations only where no GPU or TPU runs them (batch_norm.cpu_only).
"""

from imagenet_tpu.cpu.batch_norm import BatchNormalization, cpu_only
from imagenet_tpu.cpu.convolution import Conv2D, tune_network

__all__ = ['BatchNormalization', 'Conv2D', 'cpu_only', 'tune_network']
