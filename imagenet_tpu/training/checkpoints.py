"""Checkpoints of a run: where they go (the chief's; the other workers' are deleted once written), saving at
intervals (and on SIGTERM: sigterm_saves.py), and restoring the newest readable one.

TensorFlow writes a checkpoint's files under temporary names and updates the folder's `checkpoint` state file
last; checkpoints are found by listing their ckpt-STEP.index files, so a missing or damaged state file hides none.
"""

import os
import re
from typing import List, Optional

import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management  # pylint: disable=no-name-in-module
import tf_keras as keras

from imagenet_tpu import files
from imagenet_tpu.errors import CheckpointError, TrainingDiverged
from imagenet_tpu.training import preemption


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


class RunCheckpoints(tf.train.CheckpointManager):
    """TensorFlow's CheckpointManager, whose rotation deletes exactly the files of the checkpoints it drops, in
    its own folder. TensorFlow's deletes by glob pattern (checkpoint_management.py _sweep, _delete_file_if_exists)
    with the folder's name in the pattern: a model_dir named runs/exp[1] matched runs/exp1's checkpoints and
    deleted them; and a `checkpoint` state file naming checkpoints elsewhere (absolute paths) had those deleted."""

    def _sweep(self):
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            prefix, _ = self._maybe_delete.popitem(last=False)
            remove_checkpoint_files(self.directory, prefix)


def remove_checkpoint_files(directory: str, prefix: str) -> List[str]:
    """Deletes checkpoint ``prefix``'s files (PREFIX.index, PREFIX.data-NNNNN-of-NNNNN) when ``prefix`` names a
    checkpoint in ``directory`` itself; nothing elsewhere. Names are compared, never matched as a pattern.
    Returns the names deleted."""
    if os.path.normpath(os.path.dirname(prefix) or directory) != os.path.normpath(directory):
        return []
    name = os.path.basename(prefix)
    if not _CHECKPOINT_INDEX.fullmatch(f'{name}.index'):
        return []
    data = re.compile(re.escape(name) + r'\.data-\d{5}-of-\d{5}')
    try:
        names = tf.io.gfile.listdir(directory)
    except (tf.errors.NotFoundError, NotADirectoryError, FileNotFoundError):
        return []
    removed = [entry for entry in names if entry == f'{name}.index' or data.fullmatch(entry)]
    for entry in removed:
        files.remove_tree(os.path.join(directory, entry))
    return removed


class WorkerScratchCheckpoints(RunCheckpoints):
    """The checkpoint manager of a non-chief worker: it takes part in every save (which is collective), and
    deletes its copy once written, as TensorFlow's PreemptionCheckpointHandler does with the copies it makes.
    Only the chief's copy is kept and read. The scratch folder is made anew before each save, so a link planted
    in its place is removed, not written through."""

    def save(self, *args, **kwargs):
        files.remove_tree(self.directory)
        files.real_directory(self.directory)
        path = super().save(*args, **kwargs)
        files.remove_tree(self.directory)
        return path


def run_checkpoint(classifier: keras.Model) -> tf.train.Checkpoint:
    """What a run's checkpoint holds: the network and the optimizer (slots and step)."""
    return tf.train.Checkpoint(network=classifier.network, optimizer=classifier.optimizer)


def checkpoint_manager(classifier: keras.Model, model_dir: str,
                       strategy: Optional[tf.distribute.Strategy] = None) -> tf.train.CheckpointManager:
    """Checkpoints of network and optimizer in checkpoint_directory(model_dir), named ckpt-STEP; the last 3
    are kept (the non-chief workers keep none: WorkerScratchCheckpoints)."""
    checkpoint = run_checkpoint(classifier)
    strategy = strategy or tf.distribute.get_strategy()
    if not is_chief(strategy):
        # a previous run's scratch, or a link planted there
        files.remove_tree(checkpoint_directory(model_dir, strategy))
    if is_chief(strategy):
        return RunCheckpoints(checkpoint, checkpoint_directory(model_dir, strategy), max_to_keep=3,
                              checkpoint_name='ckpt')
    return WorkerScratchCheckpoints(checkpoint, checkpoint_directory(model_dir, strategy), max_to_keep=None,
                                    checkpoint_name='ckpt')


def checkpoint_variables(manager: tf.train.CheckpointManager) -> list:
    """The variables a checkpoint of ``manager`` holds: the network's and the optimizer's (slots, step)."""
    checkpoint = manager.checkpoint
    variables = list(checkpoint.network.variables)
    optimizer = getattr(checkpoint, 'optimizer', None)
    if optimizer is not None:
        variables += [v for v in optimizer.variables() if v.dtype.is_floating]
    return variables


_FINITE_CHECKS = {}     # (variable refs) -> the traced check of those variables (a few lists per process)


def nonfinite_variables(variables: list) -> List[str]:
    """Names of the floating-point variables holding a NaN or an infinity: one traced call for the whole list
    (cached for the list: the check before every save reads ~160 variables of a ResNet in one step)."""
    variables = [variable for variable in variables if variable.dtype.is_floating]
    if not variables:
        return []
    key = tuple(variable.ref() for variable in variables)
    check = _FINITE_CHECKS.get(key)
    if check is None:
        if len(_FINITE_CHECKS) >= 8:
            _FINITE_CHECKS.clear()
        check = tf.function(lambda: tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in variables]))
        _FINITE_CHECKS[key] = check
    finite = check().numpy()
    return [variable.name for variable, ok in zip(variables, finite) if not ok]


def save_checkpoint(manager: tf.train.CheckpointManager, step: int) -> None:
    """Saves ckpt-STEP unless it is already the latest; never a checkpoint holding a non-finite value
    (TrainingDiverged instead), and a save that fails (a full disk) is a CheckpointError, its temporary files
    removed. TensorFlow writes the files under temporary names and updates the directory's `checkpoint` index
    last, so a crash while saving leaves the previous one latest."""
    if manager.latest_checkpoint == f'{manager.directory}/ckpt-{step}':
        return
    bad = nonfinite_variables(checkpoint_variables(manager))
    if bad:
        raise TrainingDiverged(f'{len(bad)} variables hold NaN or infinite values at step {step} (first: {bad[0]}); '
                               'not saved: the last checkpoint is the last finite one (lower the learning rate, or '
                               'check the input for bad values)')
    try:
        with preemption.saving():      # SIGTERM's deadline lets a save under way complete
            manager.save(checkpoint_number=step)
    except (tf.errors.OpError, OSError) as error:
        remove_temporary(manager.directory)
        raise CheckpointError(f'cannot write checkpoint ckpt-{step} to {manager.directory} '
                              f'({files.describe_os_error(error)}); the checkpoints before it are intact') from None


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


# How TensorFlow reports checkpoint files it cannot read (its reader reports a short data file as IndexError).
READ_ERRORS = (tf.errors.OpError, IndexError, OSError)


_CHECKPOINT_INDEX = re.compile(r'ckpt-(\d+)\.index')
_TEMPORARY = re.compile(r'ckpt-\d+_temp.*')   # a save cut short (TensorFlow writes PREFIX_temp/part-* first)


def checkpoint_paths(directory: str) -> List[str]:
    """The checkpoints in ``directory``, oldest (lowest step) first, each with ``directory`` in front: found by
    listing its ckpt-STEP.index files. TensorFlow's `checkpoint` state file is not needed (it can be missing,
    cut short or damaged without hiding a checkpoint)."""
    try:
        names = tf.io.gfile.listdir(directory)
    except (tf.errors.NotFoundError, tf.errors.FailedPreconditionError, NotADirectoryError, FileNotFoundError):
        return []
    steps = sorted(int(found.group(1)) for found in map(_CHECKPOINT_INDEX.fullmatch, names) if found)
    return [f'{directory}/ckpt-{step}' for step in steps]


def read_state(directory: str):
    """TensorFlow's checkpoint state of ``directory``, or None when it is missing or cannot be parsed."""
    try:
        return tf.train.get_checkpoint_state(directory)
    except Exception:  # pylint: disable=broad-except  (random bytes: UnicodeDecodeError, text_format's ParseError)
        return None


def repair_state(directory: str, print_fn=print) -> None:
    """Rewrites ``directory``'s `checkpoint` state file when it does not name exactly the checkpoints there
    (missing, cut short, damaged, stale), so that TensorFlow's CheckpointManager knows every one of them: it would
    otherwise overwrite or never delete them. A state file that names paths outside ``directory`` is rewritten
    too (the manager would delete what it names when it rotates). CheckpointError when the state file names
    checkpoints but none is there (deleted, or a folder copied without them): resuming would silently start from
    step 0 over the run's files."""
    paths = checkpoint_paths(directory)
    state = read_state(directory)
    if not paths:
        if state is not None and state.all_model_checkpoint_paths:
            raise CheckpointError(
                f'{directory}/checkpoint names {len(state.all_model_checkpoint_paths)} checkpoints (newest '
                f'{os.path.basename(state.model_checkpoint_path)}) but none of their files is there: put them back, '
                'or train into a new --model_dir (this one would start again from step 0)')
        return
    def full(path: str) -> str:
        return os.path.normpath(os.path.join(directory, path))
    named = [full(path) for path in state.all_model_checkpoint_paths] if state else []
    latest = full(state.model_checkpoint_path) if state else ''
    listed = [os.path.normpath(path) for path in paths]
    if named == listed and latest == listed[-1]:
        return
    listed = [os.path.basename(path) for path in paths]
    print_fn(f'warning: {directory}/checkpoint does not list the checkpoints there; rewritten from the '
             f'{len(paths)} ckpt-*.index files (newest {listed[-1]})')
    # With each checkpoint's time (its .index file's), and none preserved, the manager counts them towards
    # max_to_keep as its own: without times it would keep them for ever.
    times = [tf.io.gfile.stat(f'{path}.index').mtime_nsec / 1e9 for path in paths]
    checkpoint_management.update_checkpoint_state_internal(
        save_dir=directory, model_checkpoint_path=paths[-1], all_model_checkpoint_paths=paths,
        all_model_checkpoint_timestamps=times, last_preserved_timestamp=min(times) - 1, save_relative_paths=True)


def remove_temporary(directory: str) -> List[str]:
    """Removes the folders and files of checkpoint saves cut short (ckpt-STEP_temp*, by a kill or a full disk)
    in ``directory``; returns their names."""
    try:
        names = tf.io.gfile.listdir(directory)
    except (tf.errors.NotFoundError, tf.errors.FailedPreconditionError, NotADirectoryError, FileNotFoundError):
        return []
    removed = [name.rstrip('/') for name in names if _TEMPORARY.fullmatch(name.rstrip('/'))]
    for name in removed:
        files.remove_tree(os.path.join(directory, name))
    return removed


def restore(manager: tf.train.CheckpointManager, path: str) -> None:
    """Restores ``path`` into the manager's checkpoint (restore_checkpoint)."""
    restore_checkpoint(manager.checkpoint, path)


def restore_checkpoint(checkpoint: tf.train.Checkpoint, path: str) -> None:
    """Restores ``path`` into ``checkpoint``; CheckpointError naming the first mismatch when its variables do not
    fit the model. Files that cannot be read raise one of READ_ERRORS."""
    try:
        checkpoint.restore(path).assert_existing_objects_matched()
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
        except READ_ERRORS as error:
            print_fn(f'warning: cannot read {path} ({type(error).__name__}); trying the checkpoint before it')
            continue
        bad = nonfinite_variables(checkpoint_variables(manager))
        if not bad:
            return path
        print_fn(f'warning: {path} holds NaN or infinite values ({len(bad)} variables, first {bad[0]}); trying '
                 'the checkpoint before it')
    if paths:
        raise CheckpointError(f'none of the {len(paths)} checkpoints in {directory} can be read or holds finite '
                              'values; move them away to start afresh')
    return None


