"""The console scripts: each takes SIGTERM over (training/preemption.py) before its command's module imports
TensorFlow, then runs the command. ``python -m imagenet_tpu.commands.NAME`` does the same at the top of NAME.py."""

import importlib

from imagenet_tpu.training import preemption


def _run(name: str) -> None:
    preemption.listen()
    importlib.import_module(f'imagenet_tpu.commands.{name}').run()


def train() -> None:
    _run('train')


def evaluate() -> None:
    _run('evaluate')


def classify() -> None:
    _run('classify')


def export() -> None:
    _run('export')


def plan() -> None:
    _run('plan')


def rehearse() -> None:
    _run('rehearse')
