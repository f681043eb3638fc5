"""The ways a training run can fail, one type each, under one base class.

A caller catches RunError for every failure the package reports, or one subclass for one kind. Each message is
one line meant for the user (the command line prints it after ``error:``); commands/common.py's EXIT_STATUS maps
the types to exit statuses.
"""

import re


class RunError(Exception):
    """A training run cannot go on; the message says why in one line."""


class ConfigError(RunError, ValueError):
    """A setting that cannot work, alone or with the machine it runs on (no TPU, no GPU, replicas that do not
    divide the batch)."""


class DataError(RunError):
    """The data cannot be used: no shards, an unreadable file, labels outside the model's range, a bad record
    under bad_records='fatal'."""


class CheckpointError(RunError):
    """model_dir holds checkpoints that cannot be resumed: none readable, or of a different model."""


class OutputError(RunError):
    """A result could not be written (a full disk, a read-only folder); nothing partial is left behind."""


class TrainingDiverged(RunError):
    """The training loss became NaN or infinite."""


class StepError(RunError):
    """The training or evaluation step itself failed (not its input): a setting the device cannot run."""


class InputEnded(RunError):
    """The training stream, which is endless, ended before the last step of a fit call."""


class HostLost(RunError):
    """A host of a multi-host run stopped answering (its process died, its VM was preempted or rebooted): the
    collectives of the others fail; running the same command again on every host resumes from the checkpoint."""


class Preempted(RunError):
    """Training stopped on SIGTERM after saving a checkpoint; running the same command again continues it."""


# What a runtime error from the input pipeline says, in the words of TensorFlow's kernels (first match wins).
_GRAPH_ERROR_PATTERNS = (
    r'assertion failed: \[([^\]]*)\]',                  # tfrecord.to_model_label: label out of range
    r'((?:truncated|corrupted) record at \d+)',         # a TFRecord file cut or damaged
    r'(Feature: \S+ \(data type: \w+\) is required but could not be found)',   # missing feature
    r'((?:Invalid JPEG data|Unknown image file format|jpeg)[^\n\[]*)',           # a JPEG that does not decode
)


def summarize_graph_error(message: str) -> str:
    """The line of a TensorFlow runtime error that says what went wrong (not the stack of graph nodes)."""
    for pattern in _GRAPH_ERROR_PATTERNS:
        found = re.search(pattern, message)
        if found:
            return found.group(1).strip()
    lines = [line.strip() for line in message.splitlines()
             if line.strip() and not line.startswith((' ', '\t')) and 'Graph execution error' not in line
             and 'derived errors ignored' not in line and not line.startswith('Detected at node')]
    return lines[-1] if lines else message.strip()
