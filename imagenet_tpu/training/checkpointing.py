"""Checkpoints of a run: where they go (the chief's; the other workers' are deleted once written), saving at
intervals and on SIGTERM, resuming from the newest readable one, the check that model_dir holds the same model,
and the model.fit calls a resumed run makes (fit_segments)."""

import json
import os
import signal
import threading
from typing import List, NamedTuple, Optional, Tuple

import tensorflow as tf
from tensorflow.python.util import deprecation  # pylint: disable=no-name-in-module
import tf_keras as keras

from imagenet_tpu.config import Config
from imagenet_tpu.errors import CheckpointError, ConfigError, Preempted


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes the run's shared files (checkpoints, logs, results): always, except on
    the non-chief workers of a MultiWorkerMirroredStrategy."""
    resolver = getattr(strategy, 'cluster_resolver', None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type in (None, 'chief') or (task_type == 'worker' and task_id == 0
                                            and 'chief' not in resolver.cluster_spec().as_dict())


def checkpoint_directory(model_dir: str, strategy: tf.distribute.Strategy) -> str:
    """model_dir/checkpoints for the chief. Saving is a collective step every worker of a multi-worker run
    takes, so the others write theirs to model_dir/.worker-ID, which is deleted as soon as each is written
    (WorkerScratchCheckpoints): the run's checkpoints are written once, by the chief, and every worker restores
    the chief's."""
    if is_chief(strategy):
        return os.path.join(model_dir, 'checkpoints')
    return os.path.join(model_dir, f'.worker-{strategy.cluster_resolver.task_id}')


class WorkerScratchCheckpoints(tf.train.CheckpointManager):
    """The checkpoint manager of a non-chief worker: it takes part in every save (which is collective), and
    deletes its copy once written, as TensorFlow's PreemptionCheckpointHandler does with the copies it makes.
    Only the chief's copy is kept and read."""

    def save(self, *args, **kwargs):
        path = super().save(*args, **kwargs)
        tf.io.gfile.rmtree(self.directory)
        return path


def checkpoint_manager(classifier: keras.Model, model_dir: str,
                       strategy: Optional[tf.distribute.Strategy] = None) -> tf.train.CheckpointManager:
    """Checkpoints of network and optimizer in checkpoint_directory(model_dir), named ckpt-STEP; the last 3
    are kept (the non-chief workers keep none: WorkerScratchCheckpoints)."""
    checkpoint = tf.train.Checkpoint(network=classifier.network, optimizer=classifier.optimizer)
    strategy = strategy or tf.distribute.get_strategy()
    if is_chief(strategy):
        return tf.train.CheckpointManager(checkpoint, checkpoint_directory(model_dir, strategy), max_to_keep=3,
                                          checkpoint_name='ckpt')
    return WorkerScratchCheckpoints(checkpoint, checkpoint_directory(model_dir, strategy), max_to_keep=None,
                                    checkpoint_name='ckpt')


def save_checkpoint(manager: tf.train.CheckpointManager, step: int) -> None:
    """Saves ckpt-STEP unless it is already the latest. TensorFlow writes the files under temporary names and
    updates the directory's `checkpoint` index last, so a crash while saving leaves the previous one latest."""
    if manager.latest_checkpoint != f'{manager.directory}/ckpt-{step}':
        manager.save(checkpoint_number=step)


class Checkpoints(keras.callbacks.Callback):
    """Saves network and optimizer (slots and step) as ckpt-STEP at every multiple of ``every_steps`` steps
    and at the end of training."""

    def __init__(self, manager: tf.train.CheckpointManager, every_steps: int):
        super().__init__()
        self.manager, self.every_steps = manager, every_steps

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _save(self, step: int) -> None:
        save_checkpoint(self.manager, step)

    def on_train_batch_begin(self, batch, logs=None):
        self._step_before = self._step()

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        # Crossed a multiple of every_steps (with steps_per_execution > 1 a call runs several steps).
        if step // self.every_steps > self._step_before // self.every_steps:
            self._save(step)

    def on_train_end(self, logs=None):
        self._save(self._step())


class SaveOnSigterm(keras.callbacks.Callback):
    """On SIGTERM (the preemption notice of cloud VMs), finishes the current step, saves a checkpoint and
    stops training; train_and_evaluate then raises Preempted. The handler is installed for the duration of
    training only (and only in the main thread, where Python delivers signals)."""

    def __init__(self, manager: tf.train.CheckpointManager, print_fn=print):
        super().__init__()
        self.manager, self.print_fn = manager, print_fn
        self.signalled = False
        self.saved_step = None
        self._previous = None

    def _handle(self, signum, frame):
        self.signalled = True

    def on_train_begin(self, logs=None):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def on_train_end(self, logs=None):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def on_train_batch_end(self, batch, logs=None):
        if self.signalled and self.saved_step is None:
            step = int(self.model.optimizer.iterations.numpy())
            save_checkpoint(self.manager, step)
            self.saved_step = step
            self.model.stop_training = True
            self.print_fn(f'SIGTERM: saved step {step} to {self.manager.directory}; stopping')


class SaveOnPreemptionAcrossWorkers(keras.callbacks.Callback):
    """SIGTERM to any worker of a MultiWorkerMirroredStrategy run: every worker saves the same step and
    train_and_evaluate raises Preempted on each (exit status 143: run the same command again).

    TensorFlow's own tf.distribute.experimental.PreemptionCheckpointHandler does the agreement: the worker that
    receives the signal publishes a step through the cluster's coordination service, and every worker saves its
    checkpoint at that step (the chief to model_dir/checkpoints; the others' copies are deleted once written, as
    for periodic checkpoints). Create it before restoring, so that the run's own restore has the last word.
    """

    def __init__(self, manager: tf.train.CheckpointManager, strategy: tf.distribute.Strategy, print_fn=print):
        super().__init__()
        self.manager, self.print_fn = manager, print_fn
        self.saved_step = None
        self._step = 0
        config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, grace_period=0)
        self.handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, manager, termination_config=config)

    def _exit(self):
        self.saved_step = self._step
        self.print_fn(f'preemption: every worker saved step {self._step}; stopping')
        raise Preempted(f'stopped by SIGTERM to a worker at step {self._step}, after every worker saved it; run '
                        'the same command again to continue')

    def on_train_batch_end(self, batch, logs=None):
        self._step = int(self.model.optimizer.iterations.numpy())
        with deprecation.silence():   # the handler reads its own deprecated total_run_calls when it saves
            self.handler.save_checkpoint_if_preempted(checkpoint_number=self._step)


def uses_cluster(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` is a MultiWorkerMirroredStrategy over a cluster of workers (TF_CONFIG)."""
    resolver = getattr(strategy, 'cluster_resolver', None)
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver is not None
            and bool(resolver.cluster_spec().jobs))


# The settings that define the network's variables: a checkpoint only fits a network built with the same ones.
MODEL_SETTINGS = ('depth', 'num_classes', 'image_size', 'norm', 'space_to_depth')


def check_model_settings(config: Config, model_dir: str) -> None:
    """Records the model-defining settings in model_dir/model.json on the first run; on a later run refuses to
    resume from a checkpoint of a different model, naming each setting that differs."""
    path = os.path.join(model_dir, 'model.json')
    current = {name: getattr(config, name) for name in MODEL_SETTINGS}
    if tf.io.gfile.exists(path):
        with tf.io.gfile.GFile(path) as f:
            saved = json.load(f)
        differences = [f'{name}={saved.get(name)!r} there, {value!r} now' for name, value in current.items()
                       if saved.get(name) != value]
        if differences:
            raise CheckpointError(f'--model_dir {model_dir} holds checkpoints of a different model ('
                              + '; '.join(differences) + '): use another --model_dir or the same settings')
    else:
        tf.io.gfile.makedirs(model_dir)
        with tf.io.gfile.GFile(path, 'w') as f:
            json.dump(current, f, indent=2)


# How TensorFlow reports checkpoint files it cannot read (its reader reports a short data file as IndexError).
READ_ERRORS = (tf.errors.OpError, IndexError, OSError)


def checkpoint_paths(directory: str) -> List[str]:
    """The checkpoints of ``directory``'s index, oldest first, each with ``directory`` in front."""
    state = tf.train.get_checkpoint_state(directory)
    paths = list(state.all_model_checkpoint_paths) if state else []
    if state and state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    return paths


def restore(manager: tf.train.CheckpointManager, path: str) -> None:
    """Restores ``path`` into the manager's checkpoint; CheckpointError naming the first mismatch when its
    variables do not fit the model. Files that cannot be read raise one of READ_ERRORS."""
    try:
        manager.checkpoint.restore(path).assert_existing_objects_matched()
    except (AssertionError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        raise CheckpointError(f'{path} does not fit this model: {first_line}') from None


def restore_latest(manager: tf.train.CheckpointManager, print_fn=print,
                   directory: Optional[str] = None) -> Optional[str]:
    """Restores the newest readable checkpoint of ``directory`` (default: the manager's); returns its path.

    A checkpoint whose files are damaged (e.g. a disk filled while writing it) is reported and the one before
    it tried; when none can be read, CheckpointError (never a silent fresh start). A checkpoint whose variables
    do not fit the model is a CheckpointError naming the first mismatch, not a fresh start.
    """
    directory = directory or manager.directory
    paths = checkpoint_paths(directory)
    for path in reversed(paths):
        try:
            restore(manager, path)
            return path
        except READ_ERRORS as error:
            print_fn(f'warning: cannot read {path} ({type(error).__name__}); trying the checkpoint before it')
    if paths:
        raise CheckpointError(f'none of the {len(paths)} checkpoints in {directory} can be read; move them away to '
                              'start afresh')
    return None


class FitSegment(NamedTuple):
    initial_epoch: int
    epochs: int
    steps_per_epoch: int


def fit_segments(start_step: int, total_steps: int, steps_per_epoch: int) -> List[FitSegment]:
    """model.fit calls that run steps start_step..total_steps with epochs aligned to steps_per_epoch.

    A resumed run first finishes the interrupted epoch (a short epoch), then runs whole epochs; a final partial
    epoch (fractional train_epochs) is its own call.
    """
    segments = []
    step = start_step
    while step < total_steps:
        epoch, done = divmod(step, steps_per_epoch)
        if done or total_steps - step < steps_per_epoch:
            steps = min(steps_per_epoch - done, total_steps - step)
            segments.append(FitSegment(epoch, epoch + 1, steps))
        else:
            whole = (total_steps - step) // steps_per_epoch
            segments.append(FitSegment(epoch, epoch + whole, steps_per_epoch))
            steps = whole * steps_per_epoch
        step += steps
    return segments


def ensure_writable(model_dir: str) -> None:
    try:
        tf.io.gfile.makedirs(model_dir)
        probe = os.path.join(model_dir, f'.write_probe-{os.getpid()}')   # one per process: workers share model_dir
        with tf.io.gfile.GFile(probe, 'w') as f:
            f.write('ok')
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ConfigError(f'--model_dir {model_dir} is not writable ({type(error).__name__})') from None


CONFIG_FILE = 'config.json'    # a run's settings, Config.to_json


def prepare_model_dir(config: Config, chief: bool) -> None:
    """Checks at start that model_dir can be written and (on the chief) holds no other model's checkpoints, and
    records the run's settings in model_dir/config.json (what the evaluation command starts from)."""
    ensure_writable(config.model_dir)
    if chief:
        check_model_settings(config, config.model_dir)
        with tf.io.gfile.GFile(os.path.join(config.model_dir, CONFIG_FILE), 'w') as f:
            f.write(config.to_json())


def resume(classifier: keras.Model, model_dir: str, strategy: tf.distribute.Strategy,
           print_fn=print) -> Tuple[tf.train.CheckpointManager, keras.callbacks.Callback]:
    """(this process's checkpoint manager, the callback that saves on SIGTERM), after restoring the run's newest
    readable checkpoint if any. Every worker resumes from the chief's checkpoints. On a cluster of workers the
    SIGTERM callback is SaveOnPreemptionAcrossWorkers, else SaveOnSigterm."""
    manager = checkpoint_manager(classifier, model_dir, strategy)
    if uses_cluster(strategy):
        on_sigterm = SaveOnPreemptionAcrossWorkers(manager, strategy, print_fn)
    else:
        on_sigterm = SaveOnSigterm(manager, print_fn)
    restored = restore_latest(manager, print_fn, os.path.join(model_dir, 'checkpoints'))
    if restored:
        print_fn(f'resumed from {restored} at step {int(classifier.optimizer.iterations.numpy())}')
    return manager, on_sigterm
