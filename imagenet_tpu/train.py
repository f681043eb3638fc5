"""The run: train_and_evaluate(config), which the command line calls and which reads top to bottom.

Process settings, strategy, model, resume, data, callbacks, fit, evaluate, export, results. The objects come from
builders.py, the model.fit calls from training/loop.py, checkpoints and resuming from training/checkpoints.py, the
run folder's checks and files from training/run_folder.py.
"""

import functools
import os
import time
from typing import Optional

import tensorflow as tf

from imagenet_tpu import builders, files
from imagenet_tpu.config import Config
from imagenet_tpu.data import labels
from imagenet_tpu.data.record_io import SkipCounts
from imagenet_tpu.distribute import strategy as strategy_lib
from imagenet_tpu.serving import export
from imagenet_tpu.training import callbacks as callbacks_lib
from imagenet_tpu.training import checkpoints, loop, preemption, run_folder, sigterm_saves


def train_and_evaluate(config: Config, strategy: Optional[tf.distribute.Strategy] = None, print_fn=print) -> dict:
    """Trains for config.train_steps (resuming from config.model_dir), evaluates, returns the final metrics; the
    command line is this function and nothing more.

    Returns a dict with top_1, top_5, loss (held-out; absent for synthetic data), train_loss, steps,
    images_per_second, wall_seconds and the input's bad_records and truncated_files. Raises a subclass of
    errors.RunError on failure: Preempted after saving a checkpoint when SIGTERM arrives during training (and if
    no step ends within config.termination_grace_seconds, the process exits with status 143: preemption.py).
    """
    started = time.perf_counter()
    strategy = strategy or builders.build_strategy(config)
    with preemption.during_training(config.termination_grace_seconds):
        builders.prepare_process(config)
        chief = checkpoints.is_chief(strategy)
        lock = run_folder.prepare_model_dir(config, chief, print_fn) if config.model_dir else None
        try:
            return _train_and_evaluate(config, strategy, chief, started, print_fn)
        finally:
            if lock is not None:
                lock.release()


def _train_and_evaluate(config: Config, strategy: tf.distribute.Strategy, chief: bool, started: float,
                        print_fn) -> dict:
    builders.check_replicas(config, strategy.num_replicas_in_sync)
    grouped = config.norm != 'none' and config.bn_group_size_for(strategy.num_replicas_in_sync) > 1
    strategy_lib.check_mesh(strategy, config.mesh_shape, config.cores_per_chip,
                            uses_replica_order=grouped or config.allreduce == '2d')
    with strategy.scope():
        classifier = builders.build_classifier(config)

    # Resume: every worker restores the chief's newest readable checkpoint (none: a fresh start at step 0). The
    # SIGTERM saver is made before the restore, so that the run's own restore has the last word.
    manager = on_sigterm = None
    if config.model_dir:
        manager = checkpoints.checkpoint_manager(classifier, config.model_dir, strategy)
        on_sigterm = (sigterm_saves.SaveOnPreemptionAcrossWorkers(manager, strategy, print_fn)
                      if sigterm_saves.uses_cluster(strategy)
                      else sigterm_saves.SaveOnSigterm(manager, print_fn, config.termination_grace_seconds))
        restored = checkpoints.restore_latest(manager, print_fn, os.path.join(config.model_dir, 'checkpoints'))
        if restored:
            print_fn(f'resumed from {restored} at step {loop.current_step(classifier)}')
    start_step = loop.current_step(classifier)

    skip_counts = SkipCounts()
    watchdog = builders.build_watchdog(config)
    if watchdog:
        watchdog.start()      # the input's start-up can hang too (a hung mount, a FIFO among the shards)
    try:
        train_data, eval_data = builders.build_datasets(config, strategy, start_step, skip_counts)
    except BaseException:
        if watchdog:
            watchdog.close()
        raise
    if config.model_dir and chief:
        run_folder.record_run(config)     # only now: the data has been checked
    callbacks = builders.build_callbacks(config, classifier, strategy, manager, skip_counts, train_data, print_fn,
                                         on_sigterm, watchdog)
    print_fn(f'{config.depth}-layer ResNet, {strategy.num_replicas_in_sync} replicas '
             f'({type(strategy).__name__}), global batch {config.global_batch_size}, '
             f'{config.steps_per_epoch} steps/epoch, {config.train_steps} steps')
    if start_step >= config.train_steps:
        print_fn(f'step {start_step} of {config.train_steps} was reached by an earlier run: nothing to train')

    # Each model.fit call after the first continues the stream where the last one stopped.
    train_data_from = functools.partial(_train_stream, config, strategy, start_step, train_data, skip_counts)
    results_path = os.path.join(config.model_dir, 'results.json') if config.model_dir and chief else None
    try:
        with loop.input_errors():
            results = loop.fit(config, classifier, strategy, train_data_from, eval_data, callbacks)
            if results_path and results['steps'] > start_step:
                # The training figures now: a run stopped in its final evaluation, run again, finds them.
                files.write_json(results_path, {**run_folder.training_figures(results_path),
                                                **{name: results[name] for name in run_folder.TRAINING_FIGURES
                                                   if name in results},
                                                'wall_seconds': time.perf_counter() - started,
                                                'steps': results['steps']})
            validated = results.pop('final_validation', None)
            if validated is not None:      # the last epoch's validation evaluated the final weights
                results.update(loop.report_evaluation(config, classifier, validated, print_fn))
            elif eval_data is not None:
                results.update(loop.evaluate(config, classifier, strategy, eval_data, callbacks, print_fn))
                results['evaluations'] += 1
    finally:
        for callback in callbacks:
            if isinstance(callback, callbacks_lib.InputWatchdog):
                callback.close()
    results.update(skip_counts.totals())
    results.update(builders.run_counts(config, strategy))

    if config.model_dir and chief and config.export_saved_model:
        path = os.path.join(config.model_dir, 'saved_model')
        names, _ = labels.class_names(config.num_classes, config.label_offset, config.data_dir)
        export.export_saved_model(builders.build_export_network(config, classifier.network), path, names,
                                  **builders.export_settings(config))
        print_fn(f'exported {path}')
    results['wall_seconds'] = time.perf_counter() - started
    if results_path:
        if results['steps'] == start_step:     # nothing trained: keep the training figures of the run that did
            results = {**run_folder.training_figures(results_path), **run_folder.results_without_training(results)}
        files.write_json(results_path, results)
    return results


def _train_stream(config: Config, strategy: tf.distribute.Strategy, start_step: int, first, skip_counts, step: int):
    """The training stream of a model.fit call that starts at ``step`` (``first``: the one built for start_step)."""
    if step == start_step:
        return first
    return builders.build_train_dataset(config, strategy, step, skip_counts)
