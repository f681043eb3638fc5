"""The run folder (--model_dir): the check that it can be written, the lock that keeps a second trainer out, the
check that it holds the same model, and the files a run records there (model.json, config.json, results.json).

A run writes only inside its model_dir: checkpoints/ (checkpoints.py), logs/ (TensorBoard), model.json,
config.json, results.json, .lock, and with --export_saved_model saved_model/. Removals and the write probe never
follow a symbolic link, and the JSON files are written under a temporary name and renamed (files.py).
"""

import fcntl
import json
import os
import socket
import tempfile
from typing import Optional

import tensorflow as tf

from imagenet_tpu import files
from imagenet_tpu.config import Config
from imagenet_tpu.errors import CheckpointError, ConfigError
from imagenet_tpu.training import checkpoints


# The settings that define the network's variables: a checkpoint only fits a network built with the same ones.
MODEL_SETTINGS = ('depth', 'num_classes', 'image_size', 'norm', 'space_to_depth')
# The settings that give a checkpoint's step counter its meaning: images per step and per epoch (the learning rate
# and the data position are computed from them) and which class a label is.
RESUME_SETTINGS = {
    'global_batch_size': lambda there, now: (f"this run's checkpoints count steps of {there} images; "
                                             f'--global_batch_size={now} would resume at the wrong point'),
    'num_train_images': lambda there, now: (f"this run's epochs are {there} images; --num_train_images={now} "
                                            'would resume at the wrong point of its schedule and data'),
    'label_offset': lambda there, now: (f'this run was trained with --label_offset={there}; {now} would shift '
                                        'every class'),
}


MODEL_FILE = 'model.json'


def model_settings(config: Config) -> dict:
    """What model.json records: the settings that define the network's variables and those of RESUME_SETTINGS."""
    return {name: getattr(config, name) for name in (*MODEL_SETTINGS, *RESUME_SETTINGS)}


def check_model_settings(config: Config, model_dir: str, resuming: bool = True) -> None:
    """Refuses to resume from checkpoints of a different model, naming each setting that differs from
    model_dir/model.json, or, when ``resuming`` training, with a setting that would change what their step
    counter means (RESUME_SETTINGS; an evaluation or export reads the weights only). Without checkpoints in
    model_dir nothing binds it (a run that failed before its first checkpoint leaves no model behind), and
    record_run then writes the new settings."""
    path = os.path.join(model_dir, MODEL_FILE)
    if not checkpoints.checkpoint_paths(os.path.join(model_dir, 'checkpoints')) or not tf.io.gfile.exists(path):
        return
    saved = files.read_json_object(path, 'model settings')
    differences = [f'{name}={saved.get(name)!r} there, {getattr(config, name)!r} now' for name in MODEL_SETTINGS
                   if saved.get(name) != getattr(config, name)]
    if differences:
        raise CheckpointError(f'--model_dir {model_dir} holds checkpoints of a different model ('
                              + '; '.join(differences) + '): use another --model_dir or the same settings')
    for name, explain in RESUME_SETTINGS.items():     # absent from the model.json of older versions: not checked
        if resuming and name in saved and saved[name] != getattr(config, name):
            raise CheckpointError(f'{explain(saved[name], getattr(config, name))}: start a new --model_dir or pass '
                                  f'--{name}={saved[name]}')


def ensure_writable(model_dir: str) -> None:
    """ConfigError with the reason (a full disk, permissions) when a file cannot be written in model_dir. On a
    local disk the probe is a new file of a random name (never a link followed); workers share model_dir."""
    try:
        if files.is_local(model_dir) and os.path.lexists(model_dir) and not os.path.isdir(model_dir):
            raise ConfigError(f'--model_dir {model_dir} is a file, not a directory')
        tf.io.gfile.makedirs(model_dir)
        if files.is_local(model_dir):
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
        raise ConfigError(f'--model_dir {model_dir} is not writable ({files.describe_os_error(error)})') from None
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
        if not files.is_local(model_dir):
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, 'O_CLOEXEC', 0), 0o644)
        except OSError as error:
            raise ConfigError(f'cannot open {self.path} ({files.describe_os_error(error)})') from None
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
        removed = checkpoints.remove_temporary(directory)
        if removed:
            print_fn(f'removed {len(removed)} unfinished checkpoint saves in {directory}: {", ".join(removed)}')
        checkpoints.repair_state(directory, print_fn)
    except BaseException:
        lock.release()
        raise
    return lock


def record_run(config: Config) -> None:
    """Records the model-defining settings (model.json) and the run's settings (config.json, what the evaluation
    command starts from) in model_dir: called by the chief once the data has been checked."""
    files.write_json(os.path.join(config.model_dir, MODEL_FILE), model_settings(config))
    files.write_json(os.path.join(config.model_dir, CONFIG_FILE), json.loads(config.to_json()))


TRAINING_FIGURES = ('train_loss', 'images_per_second', 'wall_seconds')


def training_figures(path: str) -> dict:
    """The training figures (TRAINING_FIGURES) of an earlier results.json, {} if it is missing or unreadable."""
    try:
        with tf.io.gfile.GFile(path) as f:
            previous = json.load(f)
    except (tf.errors.OpError, ValueError, UnicodeDecodeError):
        return {}
    return {name: previous[name] for name in TRAINING_FIGURES if isinstance(previous, dict) and name in previous}


def results_without_training(results: dict) -> dict:
    """A run that trained no step keeps the training figures of the run that did (training_figures)."""
    return {name: value for name, value in results.items() if name not in TRAINING_FIGURES}
