"""imagenet_tpu: ResNet-50 on ImageNet at very large batch under tf.distribute (TPU pods, GPUs, CPUs).

Importing the package turns TensorFlow's oneDNN kernels on for x86 CPUs unless TF_ENABLE_ONEDNN_OPTS is set
(runtime.py says why), and makes tf.keras the Keras 2 of tf-keras, the package's Keras, unless TF_USE_LEGACY_KERAS
is set; import it before TensorFlow, as every entry point of the package does.
"""

from imagenet_tpu import runtime as _runtime

_runtime.enable_onednn()
_runtime.use_legacy_keras()

__version__ = '0.1.0'
