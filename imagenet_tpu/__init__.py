"""imagenet_tpu: ResNet-50 on ImageNet at very large batch under tf.distribute (TPU pods, GPUs, CPUs)."""

__version__ = '0.1.0'
