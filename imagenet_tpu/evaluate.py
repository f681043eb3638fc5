"""Evaluation of a run's checkpoints: top-1, top-5, loss and per-class accuracy on every validation image once
(the imagenet-tpu-eval command is commands/evaluate.py).

The run's settings come from MODEL_DIR/config.json (Config.from_json), with overrides. The batch-norm statistics
are the run's: moving averages, the last batch's, or re-estimated from training batches ('reestimate', which
then needs the training shards). Results go to MODEL_DIR/eval/: CKPT.json (top-1, top-5, loss, images),
CKPT_per_class.csv (accuracy of each class, named from labels.txt) and, for several checkpoints, accuracy.png and
summary.json.
"""

import csv
import dataclasses
import io
import json
import os
import re
import typing
from typing import List, Optional

import numpy as np
import tensorflow as tf

from imagenet_tpu import builders, files
from imagenet_tpu import config as config_lib
from imagenet_tpu.config import Config
from imagenet_tpu.data import eval_input, labels
from imagenet_tpu.distribute import strategy as strategy_lib
from imagenet_tpu.errors import CheckpointError, OutputError
from imagenet_tpu.model import batch_norm
from imagenet_tpu.training import callbacks, checkpoints, run_folder


def _check_setting_types(path: str, values: dict) -> None:
    """CheckpointError naming the first setting of ``values`` (a run's config.json) whose JSON type is not the
    field's (an int for a float is fine; null only for an Optional field)."""
    hints = typing.get_type_hints(Config)
    kinds = {field.name: kind for field, kind in config_lib.settings()}
    for name, value in values.items():
        if name not in kinds:
            continue        # a setting of another version (Config.from_json leaves it out)
        kind, is_tuple = kinds[name], typing.get_origin(kinds[name]) is tuple
        if value is None:
            fits = type(None) in typing.get_args(hints[name])
        elif is_tuple:
            fits = isinstance(value, list)
        elif kind is float:
            fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            fits = isinstance(value, int) and not isinstance(value, bool)
        else:
            fits = isinstance(value, kind)
        if not fits:
            expected = 'a list' if is_tuple else f'a {getattr(kind, "__name__", kind)}'
            raise CheckpointError(f'{path} is damaged: {name} is {value!r}, not {expected}')


def run_config(model_dir: str, overrides: Optional[dict] = None) -> Config:
    """The Config a run trained with (MODEL_DIR/config.json), with ``overrides`` applied. CheckpointError naming
    the file when it is damaged: not JSON, not an object of settings, or settings that do not make a Config."""
    path = os.path.join(model_dir, run_folder.CONFIG_FILE)
    if not tf.io.gfile.exists(path):
        raise CheckpointError(f'--model_dir {model_dir} has no {run_folder.CONFIG_FILE}: not a run of this '
                              'package, or one from before it wrote one (pass the run\'s flags, e.g. its --flagfile)')
    values = files.read_json_object(path, 'settings')
    _check_setting_types(path, values)
    text = json.dumps(values)
    try:
        return Config.from_json(text, {**(overrides or {}), 'model_dir': model_dir})
    except (TypeError, ValueError) as error:     # ConfigError is a ValueError
        try:
            Config.from_json(text)
        except (TypeError, ValueError) as saved_error:
            raise CheckpointError(f'{path} holds settings that do not load: '
                                  f'{files.first_line(saved_error)}') from None
        raise error     # the file's settings load alone: the overrides are what does not work


def select_checkpoints(model_dir: str, which: str) -> List[str]:
    """Paths of the checkpoints ``which`` names ('latest', 'all' or 'ckpt-N') in MODEL_DIR/checkpoints."""
    directory = os.path.join(model_dir, 'checkpoints')
    try:
        paths = checkpoints.checkpoint_paths(directory)
    except (ValueError, tf.errors.OpError, OSError) as error:   # a damaged state file ('checkpoint'), unreadable
        raise CheckpointError(f'cannot list the checkpoints in {directory} ({type(error).__name__}: '
                              f'{files.first_line(error)})') from None
    if not paths:
        raise CheckpointError(f'no checkpoint in {directory}')
    if which == 'latest':
        return [paths[-1]]
    if which == 'all':
        return paths
    chosen = [path for path in paths if os.path.basename(path) == which]
    if not chosen:
        raise CheckpointError(f'{directory} has no {which}; it has '
                              + ', '.join(os.path.basename(path) for path in paths))
    return chosen


def checkpoint_step(path: str) -> int:
    found = re.search(r'ckpt-(\d+)$', path)
    return int(found.group(1)) if found else -1


def batch_figures(logits: np.ndarray, labels: np.ndarray, label_smoothing: float = 0.0):
    """(loss, top-1 hit, top-5 hit) of each image of a batch: ``logits`` [images, classes], ``labels`` [images].

    The loss is the cross-entropy with the smoothed targets (1 - s) one_hot + s / classes, computed without
    building them: (1 - s) log p[label] + s / classes * sum log p (one-hot rows would be 74.5 GiB a batch of 1,024
    at 100,000 classes). Top-1: the first largest logit is the label's. Top-5: fewer than 5 classes score higher
    than the label (tf.math.in_top_k's rule, Keras's top-5 metric)."""
    logits = logits.astype(np.float64)
    rows = np.arange(len(labels))
    log_probabilities = logits - logits.max(1, keepdims=True)
    log_probabilities -= np.log(np.exp(log_probabilities).sum(1, keepdims=True))
    classes = logits.shape[1]
    losses = -((1 - label_smoothing) * log_probabilities[rows, labels]
               + label_smoothing / classes * log_probabilities.sum(1))
    own = logits[rows, labels]
    return losses, np.argmax(logits, axis=1) == labels, (logits > own[:, None]).sum(1) < 5


def evaluation_config(config: Config, replicas: int) -> Config:
    """The run's Config for evaluating or exporting on ``replicas`` replicas. At inference, batch-norm groups matter
    only with last_batch statistics: with moving averages, or statistics re-estimated over every replica, the
    network computes the same function with per-replica batch norm. So a run whose groups do not divide these
    replicas (a pod's groups of 8 evaluated on a 2-replica machine) is evaluated with groups of 1, the function
    its export twin computes (builders.build_export_network)."""
    if config.norm == 'none' or config.bn_inference_statistics == 'last_batch':
        return config
    try:
        config.bn_group_size_for(replicas)
        return config
    except config_lib.ConfigError:
        return dataclasses.replace(config, bn_group_size=1, bn_span=None)


class Evaluator:
    """A run's network under its strategy, restoring checkpoints and evaluating each on the validation set."""

    def __init__(self, config: Config, strategy: Optional[tf.distribute.Strategy] = None):
        self.strategy = strategy or builders.build_strategy(config)
        config = self.config = evaluation_config(config, self.strategy.num_replicas_in_sync)
        builders.check_replicas(config, self.strategy.num_replicas_in_sync)
        with self.strategy.scope():
            self.classifier = builders.build_classifier(config)
        # Checkpoints are restored by path (select_checkpoints), with no tf.train.CheckpointManager: making one
        # parses the run's state file, checkpoints/checkpoint, and raises on a damaged one.
        self.checkpoint = checkpoints.run_checkpoint(self.classifier)
        self.names, self.ids = labels.class_names(config.num_classes, config.label_offset, config.data_dir)
        self._step_fn = None

    def restore(self, path: str) -> None:
        try:
            checkpoints.restore_checkpoint(self.checkpoint, path)
        except checkpoints.READ_ERRORS as error:
            raise CheckpointError(f'cannot read {path} ({type(error).__name__})') from None

    def _logits_step(self):
        network, strategy = self.classifier.network, self.strategy

        @tf.function
        def step(batch):
            def replica(images, labels_, weights):
                return tf.cast(network(images, training=False), tf.float32), labels_, weights
            outputs = strategy.run(replica, args=batch)
            return [tf.concat(strategy.experimental_local_results(value), axis=0) for value in outputs]
        return step

    def prepare(self, path: str) -> None:
        """Restores ``path`` with the batch-norm statistics the run evaluates with (its moving averages, the last
        batch's, or re-estimated from training batches at the checkpoint's step)."""
        config = self.config
        self.restore(path)
        network = self.classifier.network
        if config.norm != 'none':
            callbacks.average_moving_statistics(network, self.strategy)
            if config.bn_inference_statistics == 'reestimate':
                train_data = builders.build_train_dataset(config, self.strategy, checkpoint_step(path))
                batch_norm.reestimate_statistics(network, iter(train_data), config.bn_reestimate_batches,
                                                 self.strategy)

    def evaluate(self, path: str) -> dict:
        """Restores ``path`` and evaluates it: top_1, top_5, loss (with the run's label smoothing), images, and
        per_class (images and top-1 of each class)."""
        config = self.config
        self.prepare(path)
        self._step_fn = self._step_fn or self._logits_step()
        eval_data = builders.build_eval_dataset(config, self.strategy)
        steps = eval_input.eval_steps(config, strategy_lib.num_input_pipelines(self.strategy))
        classes = config.num_classes
        correct, counts = np.zeros(classes), np.zeros(classes)
        top_5, loss_sum = 0.0, 0.0
        iterator = iter(eval_data)
        for _ in range(steps):
            logits, labels_, weights = (value.numpy() for value in self._step_fn(next(iterator)))
            keep = weights > 0
            logits, labels_ = logits[keep], labels_[keep]
            losses, hits, in_top_5 = batch_figures(logits, labels_, config.label_smoothing)
            loss_sum += float(losses.sum())
            np.add.at(counts, labels_, 1)
            np.add.at(correct, labels_, hits)
            top_5 += float(in_top_5.sum())
        images = int(counts.sum())
        return {'checkpoint': os.path.basename(path), 'step': checkpoint_step(path), 'images': images,
                'top_1': float(correct.sum() / max(images, 1)), 'top_5': top_5 / max(images, 1),
                'loss': loss_sum / max(images, 1),
                'per_class': [{'class': index, 'id': self.ids[index], 'name': self.names[index],
                               'images': int(counts[index]),
                               'top_1': float(correct[index] / counts[index]) if counts[index] else float('nan')}
                              for index in range(classes)]}


def write_results(model_dir: str, result: dict) -> str:
    """RUN/eval/CKPT.json and CKPT_per_class.csv, each written atomically (a link there is replaced, not written
    through; a link at RUN/eval is removed, not followed); returns the folder."""
    folder = os.path.join(model_dir, 'eval')
    try:
        files.real_directory(folder)
    except (tf.errors.OpError, OSError) as error:
        raise OutputError(f'cannot make {folder} ({files.describe_os_error(error)})') from None
    name = result['checkpoint']
    files.write_json(os.path.join(folder, f'{name}.json'),
                     {key: value for key, value in result.items() if key != 'per_class'})
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(['class', 'id', 'name', 'images', 'top_1'])
    for row in result['per_class']:
        writer.writerow([row['class'], row['id'], row['name'], row['images'], f'{row["top_1"]:.6f}'])
    files.write_atomically(os.path.join(folder, f'{name}_per_class.csv'), table.getvalue())
    return folder


def plot(results: List[dict], path: str) -> None:
    """Top-1 and top-5 over the checkpoints' steps, as a PNG."""
    import matplotlib  # pylint: disable=import-outside-toplevel  (only for runs with several checkpoints)
    matplotlib.use('Agg')
    from matplotlib import pyplot
    figure, axis = pyplot.subplots(figsize=(7, 4))
    steps = [result['step'] for result in results]
    for key, label in (('top_1', 'top-1'), ('top_5', 'top-5')):
        axis.plot(steps, [100 * result[key] for result in results], marker='o', label=label)
    axis.set_xlabel('training step')
    axis.set_ylabel('held-out accuracy (%)')
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format='png', dpi=100)
    pyplot.close(figure)
    files.write_atomically(path, image.getvalue())


def evaluate_run(config: Config, which: str = 'latest', strategy: Optional[tf.distribute.Strategy] = None,
                 print_fn=print) -> List[dict]:
    """Evaluates the checkpoints ``which`` names of config.model_dir; writes and returns their results."""
    paths = select_checkpoints(config.model_dir, which)
    run_folder.check_model_settings(config, config.model_dir, resuming=False)
    evaluator = Evaluator(config, strategy)
    results = []
    for path in paths:
        result = evaluator.evaluate(path)
        # The figures first: a write that fails below still leaves them on the screen.
        print_fn(f'{result["checkpoint"]} (step {result["step"]}): top-1 {100 * result["top_1"]:.2f}% top-5 '
                 f'{100 * result["top_5"]:.2f}% loss {result["loss"]:.4f} on {result["images"]} images')
        if result['images'] != config.num_eval_images:
            print_fn(f'warning: evaluated {result["images"]} images but --num_eval_images={config.num_eval_images}')
        folder = write_results(config.model_dir, result)
        results.append(result)
    if len(results) > 1:
        plot(results, os.path.join(folder, 'accuracy.png'))
        files.write_json(os.path.join(folder, 'summary.json'),
                         [{key: value for key, value in result.items() if key != 'per_class'} for result in results])
        print_fn(f'wrote {os.path.join(folder, "accuracy.png")}')
    return results
