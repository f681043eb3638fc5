"""Process set-up that has to happen before TensorFlow starts, and a report of what is in force.

- oneDNN on x86 CPUs. TensorFlow 2.20 turns its oneDNN kernels on by itself only on CPUs with AVX-512-class
  features; on others (AVX2-only AMD EPYC and Intel desktop parts, for example) it runs Eigen's kernels, several
  times slower for a ResNet training step (docs/benchmarks.md).
  TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, as it is imported, so the package sets it when it is itself imported
  (imagenet_tpu/__init__.py), which every entry point does before importing TensorFlow. A value the user has set,
  0 included, is left alone: `TF_ENABLE_ONEDNN_OPTS=0 imagenet-tpu-train ...` turns oneDNN off.
- A quiet start on machines without a GPU. The tensorflow wheel carries CUDA support and, on a machine without an
  NVIDIA driver, logs `E ... cuda_platform.cc:51] failed call to cuInit: ...` when it first lists its devices:
  an error line that only says there is no GPU. import_tensorflow holds that line (and the matching "Could not
  find cuda drivers" notice) back where no NVIDIA driver is loaded, and passes every other line on.
- Keras 2 as tf.keras (use_legacy_keras). The package's Keras is tf-keras (`import tf_keras as keras`); TensorFlow
  2.20's tf.keras is Keras 3 unless TF_USE_LEGACY_KERAS is set, and TensorFlow imports Keras 3's optimizers as it is
  itself imported, about 0.9 s of every start of a process (docs/benchmarks.md X24), to register them for SavedModels.
  With the variable set, tf.keras is tf-keras, the Keras the package's models are made of, and TensorFlow registers
  tf-keras's optimizers instead. A value the user has set is left alone.
- glibc's malloc arenas (limit_malloc_arenas).

Nothing here imports TensorFlow at module level, so importing this module is free and settles the environment.
"""

import ctypes
import os
import platform
import re
import subprocess
import sys
import tempfile
import warnings
from typing import Mapping, Optional

ONEDNN_VARIABLE = 'TF_ENABLE_ONEDNN_OPTS'
LEGACY_KERAS_VARIABLE = 'TF_USE_LEGACY_KERAS'
_X86_MACHINES = frozenset({'x86_64', 'amd64', 'x86', 'i386', 'i686'})

# Set by enable_onednn: who decided the oneDNN setting of this process.
onednn_source = None


def onednn_setting(environ: Mapping[str, str], machine: str, tensorflow_imported: bool) -> Optional[str]:
    """The value to give TF_ENABLE_ONEDNN_OPTS, or None to leave the environment as it is.

    '1' on x86 machines when the user has not set the variable and TensorFlow has not been imported yet (after
    that, setting it has no effect); None otherwise (ARM and other machines keep TensorFlow's own default)."""
    if ONEDNN_VARIABLE in environ or tensorflow_imported:
        return None
    return '1' if machine.lower() in _X86_MACHINES else None


def enable_onednn() -> Optional[str]:
    """Turns oneDNN on for this process where onednn_setting says so; returns who decided the setting: 'user'
    (the variable was set), 'imagenet_tpu' (set now), 'tensorflow' (left to its default) or 'too late'
    (TensorFlow was imported first: a warning is given when oneDNN is then off on an x86 CPU)."""
    global onednn_source
    imported = 'tensorflow' in sys.modules
    value = onednn_setting(os.environ, platform.machine(), imported)
    if value is not None:
        os.environ[ONEDNN_VARIABLE] = value
        onednn_source = 'imagenet_tpu'
    elif ONEDNN_VARIABLE in os.environ:
        onednn_source = 'user'
    elif imported and platform.machine().lower() in _X86_MACHINES:
        onednn_source = 'too late'
        if not onednn_enabled():
            warnings.warn('TensorFlow was imported before imagenet_tpu with its oneDNN kernels off on this CPU, so '
                          'training runs several times slower: import imagenet_tpu first, or set '
                          f'{ONEDNN_VARIABLE}=1 before starting Python', RuntimeWarning, stacklevel=3)
    else:
        onednn_source = 'tensorflow'
    return onednn_source


def use_legacy_keras() -> bool:
    """Sets TF_USE_LEGACY_KERAS=1 (tf.keras is tf-keras) unless the user has set it or TensorFlow is already
    imported (it reads the variable as it is imported); returns whether it was set now."""
    if LEGACY_KERAS_VARIABLE in os.environ or 'tensorflow' in sys.modules:
        return False
    os.environ[LEGACY_KERAS_VARIABLE] = '1'
    return True


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its oneDNN kernels in this process (imports TensorFlow)."""
    import_tensorflow()
    from tensorflow.python.util import _pywrap_util_port   # pylint: disable=import-outside-toplevel
    return bool(_pywrap_util_port.IsMklEnabled())


# Lines TensorFlow prints at start-up that only say that no GPU is there.
_NO_GPU_LINES = re.compile(r'failed call to cuInit|Could not find cuda drivers on your machine')


def startup_lines_to_show(text: str, gpu_expected: bool) -> str:
    """What TensorFlow wrote to stderr while listing its devices, less the lines that only say that there is no
    GPU; all of it where a GPU is expected (a driver is installed), since there the same line explains why a
    GPU is missing."""
    lines = text.splitlines(keepends=True)
    return ''.join(line for line in lines if gpu_expected or not _NO_GPU_LINES.search(line))


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded (Linux)."""
    return os.path.exists('/proc/driver/nvidia') or os.path.exists('/dev/nvidiactl')


def import_tensorflow():
    """Imports TensorFlow and lets it list its physical devices (where it probes CUDA); returns the module.

    While it is imported and lists them, what TensorFlow writes to stderr is held and passed on afterwards, less
    the lines that only say that there is no GPU, on machines without an NVIDIA driver (startup_lines_to_show).
    TensorFlow's C++ log shows errors only (TF_CPP_MIN_LOG_LEVEL=2) unless the variable is set. Call it before
    anything else touches TensorFlow's devices; logical device configuration (strategy.use_logical_cpus) is
    still possible after it."""
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')   # TensorFlow's C++ errors, not its start-up notices
    if 'tensorflow' in sys.modules or sys.stderr is None:
        import tensorflow as tf   # pylint: disable=import-outside-toplevel
        return tf
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        import tensorflow as tf   # pylint: disable=import-outside-toplevel
        return tf      # no usable stderr: nothing to hold back
    gpus = []
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            # Under absl's app.run, TensorFlow probes CUDA as it is imported, not when it lists its devices.
            import tensorflow as tf   # pylint: disable=import-outside-toplevel
            gpus = tf.config.list_physical_devices('GPU')
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = startup_lines_to_show(captured.read().decode(errors='replace'),
                                         bool(gpus) or nvidia_driver_present())
            if kept:
                os.write(2, kept.encode())
    return tf


def cpu_description(cpuinfo: str = '/proc/cpuinfo') -> dict:
    """The CPU as Linux reports it in ``cpuinfo``: model name, family and model number (x86; '' where absent) and
    sorted flags (ARM's Hardware and Features lines stand for the name and flags). A hypervisor may show only a
    generic name ('AMD EPYC' for CPUs a generation and twice the speed apart): the family and model number tell
    them apart. Elsewhere platform.processor() names it."""
    keys = {'model name': 'model', 'Hardware': 'model', 'cpu family': 'family', 'model': 'model_number',
            'flags': 'flags', 'Features': 'flags'}
    found = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                name, _, value = line.partition(':')
                key = keys.get(name.strip())
                if key and key not in found:
                    found[key] = value.strip()
    except OSError:
        pass
    return {'model': found.get('model') or platform.processor() or platform.machine(),
            'family': found.get('family', ''), 'model_number': found.get('model_number', ''),
            'flags': ' '.join(sorted(found.get('flags', '').split()))}


def cpu_model(cpuinfo: str = '/proc/cpuinfo') -> str:
    """The CPU's model name, with its family and model number where Linux gives them: 'AMD EPYC (family 25,
    model 17)'."""
    cpu = cpu_description(cpuinfo)
    if cpu['family'] and cpu['model_number']:
        return f"{cpu['model']} (family {cpu['family']}, model {cpu['model_number']})"
    return cpu['model']


def tensorflow_cpu_features() -> str:
    """The CPU features TensorFlow itself reports at start-up (its cpu_feature_guard line, read from a fresh
    Python process with TensorFlow's INFO logging on), e.g. 'AVX2 FMA' or 'AVX2 AVX512F AVX512_VNNI ... FMA';
    '' where it reports none."""
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0')
    try:
        result = subprocess.run([sys.executable, '-c', 'import tensorflow'], env=environment, capture_output=True,
                                text=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError):
        return ''
    match = re.search(r'enable the following instructions: (.*?), in other operations', result.stderr)
    return match.group(1) if match else ''


def report() -> dict:
    """What the benchmarks print: CPU model, the features TensorFlow reported, and the oneDNN setting in force."""
    return {'cpu': cpu_model(), 'tensorflow_cpu_features': tensorflow_cpu_features(),
            'onednn': onednn_enabled(), ONEDNN_VARIABLE: os.environ.get(ONEDNN_VARIABLE),
            'onednn_set_by': onednn_source}


def describe(facts: dict) -> str:
    """One line of report()."""
    state = 'on' if facts['onednn'] else 'off'
    return (f"CPU: {facts['cpu']}; TensorFlow reports {facts['tensorflow_cpu_features'] or 'no extra'} features; "
            f"oneDNN {state} ({ONEDNN_VARIABLE}={facts[ONEDNN_VARIABLE]}, set by {facts['onednn_set_by']})")


_M_ARENA_MAX = -8   # glibc's malloc.h


def malloc_arenas(cores: Optional[int]) -> int:
    """The cap limit_malloc_arenas sets by default: one arena per core, at least 2. Measured on 2 cores (2 arenas);
    a TPU VM or 8-GPU host decodes JPEGs in dozens of threads, which a 2-arena cap would make queue for malloc's
    locks, while glibc's own default (8 per core) is what let resident memory climb."""
    return max(2, cores or 1)


def limit_malloc_arenas(count: Optional[int] = None) -> bool:
    """Caps glibc's malloc arenas at ``count`` (default: malloc_arenas of this machine's cores) for this process
    (call it first thing, before threads start).

    Each data epoch of input_pipeline.train_dataset starts new tf.data worker threads; glibc gives threads their
    own arenas (up to 8 per core) and keeps what they freed, so resident memory climbed by about 90 MiB per epoch
    of the benchmark set (921 -> 1,757 MiB over 10 epochs, 2 cores) with nothing leaked; with 2 arenas it held at
    1.08-1.09 GiB at the same speed. Returns whether the cap was set (False off glibc)."""
    count = count if count is not None else malloc_arenas(os.cpu_count())
    try:
        libc = ctypes.CDLL('libc.so.6')
        return bool(libc.mallopt(_M_ARENA_MAX, count))
    except (OSError, AttributeError):
        return False
