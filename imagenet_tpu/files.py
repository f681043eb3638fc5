"""Files of a run, local or remote (gs://...): atomic JSON writes, link-safe removal, and short reasons for failed
file operations.

Nothing here follows a symbolic link it removes or replaces: removals delete the link itself, never its target, and
JSON is written under a temporary name and renamed, which replaces a link instead of writing through it.

TensorFlow (for tf.io.gfile, which reads gs://... as well as local paths) is imported by the functions that need
it: the data converter's main process and the commands' SIGTERM set-up import this module before TensorFlow.
"""

import errno
import fnmatch
import json
import math
import os
import shutil
import stat

from imagenet_tpu.errors import CheckpointError, OutputError


def is_local(path: str) -> bool:
    """Whether ``path`` is on this machine's file system (not gs://... or another remote scheme)."""
    return '://' not in path


def matching(pattern: str) -> list:
    """The paths in ``pattern``'s folder whose names match its last part (``*`` and ``?``), sorted. Only the name
    is a pattern: the folder is taken as written, so a folder named set[1] is that folder, where
    tf.io.gfile.glob would read it as a pattern and list set1's files instead."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (module docstring)
    folder, name = os.path.split(pattern)
    try:
        names = tf.io.gfile.listdir(folder or '.')
    except (tf.errors.NotFoundError, tf.errors.FailedPreconditionError, NotADirectoryError, FileNotFoundError):
        return []
    return sorted(os.path.join(folder, entry.rstrip('/')) for entry in names
                  if fnmatch.fnmatchcase(entry.rstrip('/'), name))


def describe_os_error(error: BaseException) -> str:
    """A short reason for a failed file operation: 'No space left on device', 'Permission denied', ..."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (module docstring)
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
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (module docstring)
    if not is_local(path):
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
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (module docstring)
    if is_local(path) and (os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path))):
        os.unlink(path)
    tf.io.gfile.makedirs(path)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in ``path`` (``what`` it holds, for the message); CheckpointError naming the file when it
    cannot be read, is not UTF-8 JSON, or holds another kind of value."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (module docstring)
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


def finite_or_none(value):
    """``value`` with every non-finite float (also inside dicts and lists) as None: JSON's null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_json(path: str, value) -> None:
    """Writes ``value`` as JSON (NaN and infinities as null: valid JSON) atomically (write_atomically)."""
    write_atomically(path, json.dumps(finite_or_none(value), indent=2, allow_nan=False))


def write_atomically(path: str, data) -> None:
    """Writes ``data`` (str or bytes) under a temporary name in the same folder, then renames it over ``path``: a
    reader never sees half a file, and a link at ``path`` is replaced, not written through. A write that fails (a
    full disk, a read-only folder) is an OutputError naming the path and the reason, and leaves no file behind."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (module docstring)
    temporary = os.path.join(os.path.dirname(path), f'.{os.path.basename(path)}.tmp-{os.getpid()}')
    try:
        with tf.io.gfile.GFile(temporary, 'wb' if isinstance(data, bytes) else 'w') as f:
            f.write(data)
        tf.io.gfile.rename(temporary, path, overwrite=True)
    except (tf.errors.OpError, OSError) as error:
        try:
            remove_tree(temporary)
        except (tf.errors.OpError, OSError):
            pass
        raise OutputError(f'cannot write {path} ({describe_os_error(error)})') from None
