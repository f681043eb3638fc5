"""The console scripts and the one place absl flags are read: train (imagenet-tpu-train), evaluate
(imagenet-tpu-eval), classify (imagenet-tpu-classify) and data_service (python -m imagenet_tpu.commands.data_service).
"""
