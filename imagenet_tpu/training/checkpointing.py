"""Checkpoints of a run: where they go (the chief's; the other workers' are deleted once written), saving at
intervals and on SIGTERM, resuming from the newest readable one, the check that model_dir holds the same model,
the lock that keeps a second trainer out, and the model.fit calls a resumed run makes (fit_segments).

Nothing outside model_dir is written or deleted: removals and the write probe never follow a symbolic link, and
the files of ours (model.json, config.json, results.json) are written under a temporary name and renamed, which
replaces a link instead of writing through it.
"""

import errno
import json
import math
import os
import re
import shutil
import socket
import stat
import tempfile
from typing import List, NamedTuple, Optional, Tuple

import tensorflow as tf
from tensorflow.python.util import deprecation  # pylint: disable=no-name-in-module
import tf_keras as keras

from imagenet_tpu.config import Config
from imagenet_tpu.data import record_counts
from imagenet_tpu.errors import CheckpointError, ConfigError, Preempted, TrainingDiverged
from imagenet_tpu.training import termination


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


def describe_os_error(error: BaseException) -> str:
    """A short reason for a failed file operation: 'No space left on device', 'Permission denied', ..."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if isinstance(error, tf.errors.OpError):
        message = error.message.strip().splitlines()[0] if error.message.strip() else ''
        for code in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            if os.strerror(code).lower() in message.lower():
                return os.strerror(code)
        return message[:200] or type(error).__name__
    return type(error).__name__


def remove_tree(path: str) -> None:
    """Deletes ``path`` and what is under it without following a symbolic link: a link (to a folder or a file)
    is removed itself, never its target, at the top or anywhere below (shutil.rmtree works on file descriptors
    on Linux and does not follow links). Remote paths (gs://..., which have no links) go through tf.io.gfile."""
    if not record_counts.is_local(path):
        if tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
        return
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def real_directory(path: str) -> None:
    """Makes ``path`` a directory of its own: a symbolic link (or file) there is removed first (not its target)."""
    if record_counts.is_local(path) and (os.path.islink(path) or
                                         (os.path.lexists(path) and not os.path.isdir(path))):
        os.unlink(path)
    tf.io.gfile.makedirs(path)


class WorkerScratchCheckpoints(tf.train.CheckpointManager):
    """The checkpoint manager of a non-chief worker: it takes part in every save (which is collective), and
    deletes its copy once written, as TensorFlow's PreemptionCheckpointHandler does with the copies it makes.
    Only the chief's copy is kept and read. The scratch folder is made anew before each save, so a link planted
    in its place is removed, not written through."""

    def save(self, *args, **kwargs):
        remove_tree(self.directory)
        real_directory(self.directory)
        path = super().save(*args, **kwargs)
        remove_tree(self.directory)
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
        remove_tree(checkpoint_directory(model_dir, strategy))   # a previous run's scratch, or a link planted there
    if is_chief(strategy):
        return tf.train.CheckpointManager(checkpoint, checkpoint_directory(model_dir, strategy), max_to_keep=3,
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
        manager.save(checkpoint_number=step)
    except (tf.errors.OpError, OSError) as error:
        remove_temporary(manager.directory)
        raise CheckpointError(f'cannot write checkpoint ckpt-{step} to {manager.directory} '
                              f'({describe_os_error(error)}); the checkpoints before it are intact') from None


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
    """On SIGTERM (the preemption notice of cloud VMs), saves a checkpoint at the end of the current training
    step (or evaluation batch) and raises Preempted at once: no evaluation runs after it. SIGTERM is watched
    by termination.py, which also ends the process ``grace_seconds`` after the signal if no step ends (a stalled
    input); called from a program of its own, the callback watches for the duration of training."""

    def __init__(self, manager: tf.train.CheckpointManager, print_fn=print, grace_seconds: float = 25.0):
        super().__init__()
        self.manager, self.print_fn, self.grace_seconds = manager, print_fn, grace_seconds
        self.saved_step = None
        self._watch = None

    def on_train_begin(self, logs=None):
        if not termination.active():
            self._watch = termination.during_training(self.grace_seconds)
            self._watch.__enter__()

    def _stop_watching(self):
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)

    def on_train_end(self, logs=None):
        self._stop_watching()

    def _save_and_stop(self):
        if not termination.requested() or self.saved_step is not None:
            return
        step = int(self.model.optimizer.iterations.numpy())
        save_checkpoint(self.manager, step)
        self.saved_step = step
        self.model.stop_training = True
        self.print_fn(f'SIGTERM: saved step {step} to {self.manager.directory}; stopping')
        self._stop_watching()
        raise Preempted(f'stopped by SIGTERM at step {step} after saving it; run the same command again to '
                        'continue')

    def on_train_batch_end(self, batch, logs=None):
        self._save_and_stop()

    def on_test_batch_end(self, batch, logs=None):
        self._save_and_stop()


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


MODEL_FILE = 'model.json'


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in ``path`` (``what`` it holds, for the message); CheckpointError naming the file when it
    cannot be read, is not UTF-8 JSON, or holds another kind of value."""
    try:
        with tf.io.gfile.GFile(path) as f:
            value = json.loads(f.read())
    except UnicodeDecodeError:
        raise CheckpointError(f'{path} is damaged: not UTF-8 text') from None
    except ValueError as error:     # json.JSONDecodeError: cut short, or not JSON at all
        raise CheckpointError(f'{path} is damaged: not valid JSON ({first_line(error)})') from None
    except (tf.errors.OpError, OSError) as error:
        raise CheckpointError(f'cannot read {path} ({type(error).__name__}: {first_line(error)})') from None
    if not isinstance(value, dict):
        raise CheckpointError(f'{path} is damaged: a JSON {type(value).__name__}, not an object of {what}')
    return value


def model_settings(config: Config) -> dict:
    return {name: getattr(config, name) for name in MODEL_SETTINGS}


def check_model_settings(config: Config, model_dir: str) -> None:
    """Refuses to resume from checkpoints of a different model, naming each setting that differs from
    model_dir/model.json. Without checkpoints in model_dir nothing binds it (a run that failed before its first
    checkpoint leaves no model behind), and record_run then writes the new settings."""
    path = os.path.join(model_dir, MODEL_FILE)
    if not checkpoint_paths(os.path.join(model_dir, 'checkpoints')) or not tf.io.gfile.exists(path):
        return
    saved = read_json_object(path, 'model settings')
    differences = [f'{name}={saved.get(name)!r} there, {value!r} now' for name, value in model_settings(config).items()
                   if saved.get(name) != value]
    if differences:
        raise CheckpointError(f'--model_dir {model_dir} holds checkpoints of a different model ('
                              + '; '.join(differences) + '): use another --model_dir or the same settings')


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def write_json(path: str, value) -> None:
    """Writes ``value`` as JSON (NaN and infinities as null: valid JSON) under a temporary name in the same folder,
    then renames it over ``path``: a reader never sees half a file, and a link at ``path`` is replaced, not written
    through."""
    text = json.dumps(_finite_or_none(value), indent=2, allow_nan=False)
    temporary = os.path.join(os.path.dirname(path), f'.{os.path.basename(path)}.tmp-{os.getpid()}')
    with tf.io.gfile.GFile(temporary, 'w') as f:
        f.write(text)
    tf.io.gfile.rename(temporary, path, overwrite=True)


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
    otherwise overwrite or never delete them."""
    paths = checkpoint_paths(directory)
    if not paths:
        return
    state = read_state(directory)
    named = [os.path.basename(path) for path in state.all_model_checkpoint_paths] if state else []
    latest = os.path.basename(state.model_checkpoint_path) if state else ''
    listed = [os.path.basename(path) for path in paths]
    if named == listed and latest == listed[-1]:
        return
    print_fn(f'warning: {directory}/checkpoint does not list the checkpoints there; rewritten from the '
             f'{len(paths)} ckpt-*.index files (newest {listed[-1]})')
    # With each checkpoint's time (its .index file's), and none preserved, the manager counts them towards
    # max_to_keep as its own: without times it would keep them for ever.
    times = [tf.io.gfile.stat(f'{path}.index').mtime_nsec / 1e9 for path in paths]
    from tensorflow.python.checkpoint import checkpoint_management  # pylint: disable=import-outside-toplevel
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
        remove_tree(os.path.join(directory, name))
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
    """ConfigError with the reason (a full disk, permissions) when a file cannot be written in model_dir. On a
    local disk the probe is a new file of a random name (never a link followed); workers share model_dir."""
    try:
        if record_counts.is_local(model_dir) and os.path.lexists(model_dir) and not os.path.isdir(model_dir):
            raise ConfigError(f'--model_dir {model_dir} is a file, not a directory')
        tf.io.gfile.makedirs(model_dir)
        if record_counts.is_local(model_dir):
            handle, probe = tempfile.mkstemp(prefix='.write_probe-', dir=model_dir)
            try:
                os.write(handle, b'ok')
                os.fsync(handle)
            finally:
                os.close(handle)
                os.unlink(probe)
        else:
            probe = os.path.join(model_dir, f'.write_probe-{socket.gethostname()}-{os.getpid()}')
            with tf.io.gfile.GFile(probe, 'w') as f:
                f.write('ok')
            tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ConfigError(f'--model_dir {model_dir} is not writable ({describe_os_error(error)})') from None
    checkpoints = os.path.join(model_dir, 'checkpoints')
    if tf.io.gfile.exists(checkpoints) and not tf.io.gfile.isdir(checkpoints):
        raise ConfigError(f'{checkpoints} is a file, not the folder of checkpoints: move it away')


CONFIG_FILE = 'config.json'    # a run's settings, Config.to_json
LOCK_FILE = '.lock'


class ModelDirLock:
    """An exclusive lock on a local model_dir (flock on model_dir/.lock), held while a trainer runs: a second
    trainer on the same model_dir is refused. The kernel releases it when the process ends however it ends, so a
    crashed run never leaves it stuck. Remote model_dirs (gs://...) have no such lock."""

    def __init__(self, model_dir: str):
        self.path, self._fd = os.path.join(model_dir, LOCK_FILE), None
        if not record_counts.is_local(model_dir):
            return
        import fcntl  # pylint: disable=import-outside-toplevel  (POSIX only)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, 'O_CLOEXEC', 0), 0o644)
        except OSError as error:
            raise ConfigError(f'cannot open {self.path} ({describe_os_error(error)})') from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors='replace').strip() or 'another process'
            os.close(fd)
            raise ConfigError(f'--model_dir {model_dir} is in use by another trainer ({holder}); wait for it to end '
                              'or use another --model_dir') from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f'process {os.getpid()} on {socket.gethostname()}\n'.encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)      # closing the file releases the lock
            self._fd = None


def prepare_model_dir(config: Config, chief: bool, print_fn=print) -> Optional[ModelDirLock]:
    """Checks at start that model_dir can be written; on the chief also takes the model_dir's lock (returned),
    refuses another model's checkpoints, repairs the checkpoints' state file and removes the leftovers of saves
    cut short. Nothing is recorded yet: record_run does, once the data has been checked."""
    ensure_writable(config.model_dir)
    if not chief:
        return None
    lock = ModelDirLock(config.model_dir)
    try:
        check_model_settings(config, config.model_dir)
        directory = os.path.join(config.model_dir, 'checkpoints')
        removed = remove_temporary(directory)
        if removed:
            print_fn(f'removed {len(removed)} unfinished checkpoint saves in {directory}: {", ".join(removed)}')
        repair_state(directory, print_fn)
    except BaseException:
        lock.release()
        raise
    return lock


def record_run(config: Config) -> None:
    """Records the model-defining settings (model.json) and the run's settings (config.json, what the evaluation
    command starts from) in model_dir: called by the chief once the data has been checked."""
    write_json(os.path.join(config.model_dir, MODEL_FILE), model_settings(config))
    write_json(os.path.join(config.model_dir, CONFIG_FILE), json.loads(config.to_json()))


def resume(classifier: keras.Model, model_dir: str, strategy: tf.distribute.Strategy,
           print_fn=print, grace_seconds: float = 25.0) -> Tuple[tf.train.CheckpointManager, keras.callbacks.Callback]:
    """(this process's checkpoint manager, the callback that saves on SIGTERM), after restoring the run's newest
    readable checkpoint if any. Every worker resumes from the chief's checkpoints. On a cluster of workers the
    SIGTERM callback is SaveOnPreemptionAcrossWorkers, else SaveOnSigterm."""
    manager = checkpoint_manager(classifier, model_dir, strategy)
    if uses_cluster(strategy):
        on_sigterm = SaveOnPreemptionAcrossWorkers(manager, strategy, print_fn)
    else:
        on_sigterm = SaveOnSigterm(manager, print_fn, grace_seconds)
    restored = restore_latest(manager, print_fn, os.path.join(model_dir, 'checkpoints'))
    if restored:
        print_fn(f'resumed from {restored} at step {int(classifier.optimizer.iterations.numpy())}')
    return manager, on_sigterm
