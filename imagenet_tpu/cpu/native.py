"""Our own CPU kernels (kernels/*.cc), compiled on the machine at first use and kept beside the tuning cache.

Batch norm is bound by memory on CPU, and TensorFlow's kernels (oneDNN's fused one too) make more passes over the
map than batch norm and the ReLU after it need; kernels/batch_norm.cc makes fewer (docs/benchmarks.md B13).
kernels/winograd.cc holds the transforms of Winograd's F(2x2, 3x3) convolutions (convolution.py). Both files are
compiled with the machine's C++ compiler (``$CXX``, else g++) against the installed TensorFlow's headers, for this
CPU (-march=native), into the tuning cache's folder (tuning.folder(); a temporary folder when caching is off),
under a name made of everything the binary depends on: the sources, TensorFlow's version and flags, the compiler
and the CPU. A later process loads the file. Where it cannot be built or loaded (no compiler, another TensorFlow build),
one line says so and the tuners time TensorFlow's formulations only. ``IMAGENET_TPU_NATIVE=off`` never
builds it.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, List, Optional

from imagenet_tpu import runtime
from imagenet_tpu.cpu import tuning

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'kernels')
# The file compiled (it includes the others), and every file the binary is made of.
UNIT = os.path.join(KERNELS, 'kernels.cc')
SOURCES = (UNIT, *(os.path.join(KERNELS, name) for name in ('common.h', 'batch_norm.cc', 'winograd.cc')))
ENVIRONMENT = 'IMAGENET_TPU_NATIVE'
# Compiling the kernels against TensorFlow's headers took 8-10 s on a 2-core machine; a compiler that hangs is
# given up on.
BUILD_TIMEOUT_SECONDS = 300
FLAGS = ('-O3', '-march=native', '-shared', '-fPIC', '-w')

_lock = threading.Lock()
_state: dict = {}


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get('CXX') or 'g++')


def _build_command(compiler: str, output: str) -> List[str]:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return [compiler, *FLAGS, UNIT, '-o', output, *tf.sysconfig.get_compile_flags(),
            *tf.sysconfig.get_link_flags()]


def _identity(compiler: str) -> str:
    """What the binary depends on, hashed: the source, the compiler's version, TensorFlow and the CPU."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        version = subprocess.run([compiler, '--version'], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ''
    source = b''
    for name in SOURCES:
        with open(name, 'rb') as f:
            source += f.read()
    cpu = runtime.cpu_description()
    parts = [source.decode('utf-8', 'replace'), version, tf.__version__, tf.__file__, ' '.join(FLAGS),
             ' '.join(tf.sysconfig.get_compile_flags()), cpu['model'], cpu['family'], cpu['model_number'],
             cpu['flags']]
    return hashlib.sha1('\0'.join(parts).encode()).hexdigest()[:16]


def _build(compiler: str, path: str) -> None:
    """Compiles UNIT into ``path``, atomically (a temporary file renamed), raising RuntimeError with the
    compiler's last line on failure."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.native-', suffix='.so')
    os.close(descriptor)
    try:
        try:
            result = subprocess.run(_build_command(compiler, temporary), capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f'the compiler took over {BUILD_TIMEOUT_SECONDS} s') from error
        if result.returncode != 0:
            lines = [line for line in (result.stderr or result.stdout).splitlines() if 'error' in line.lower()]
            raise RuntimeError(f'{os.path.basename(compiler)} failed: '
                               f'{(lines or ["exit code " + str(result.returncode)])[0].strip()}')
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _load() -> Any:
    if os.environ.get(ENVIRONMENT, '').lower() in ('off', 'none', '0', 'false', 'no'):
        return None
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f'no C++ compiler ({os.environ.get("CXX") or "g++"}) on PATH')
    base = tuning.folder()
    if base is None:                 # caching off: built for this process only, its file removed once loaded
        temporary = tempfile.mkdtemp(prefix='imagenet-tpu-native-')
        try:
            return _load_from(compiler, temporary)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
    return _load_from(compiler, base)


def _load_library(path: str) -> Any:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        return tf.load_op_library(path)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError, OSError) as error:
        raise RuntimeError(f'cannot load {path}: {str(error).splitlines()[0] if str(error) else error}') from error


def _load_from(compiler: str, base: str) -> Any:
    """The library for this machine in ``base``: loaded, else built there and loaded. A file there that does not
    load (cut short by a full disk, say) is built again once, with one line."""
    path = os.path.join(base, f'native-{_identity(compiler)}.so')
    if os.path.exists(path):
        try:
            return _load_library(path)
        except RuntimeError as error:
            print(f'imagenet_tpu: {error}: compiling it again', file=sys.stderr, flush=True)
    else:
        print(f'imagenet_tpu: compiling our CPU kernels for this machine into {path}', file=sys.stderr,
              flush=True)
    _build(compiler, path)
    return _load_library(path)


def library() -> Any:
    """The compiled kernels' module (its ops as functions: imagenet_tpu_batch_norm, imagenet_tpu_winograd_input,
    ...), None where they cannot be built or are turned off (one line to stderr, once a process). Loaded once a
    process: TensorFlow would reject the ops of a second copy of the library from another path (their kernels
    registered twice)."""
    with _lock:
        if 'library' not in _state:
            try:
                _state['library'] = _load()
            except (RuntimeError, OSError) as error:
                print(f'warning: our CPU kernels are not available ({error}): using TensorFlow\'s',
                      file=sys.stderr, flush=True)
                _state['library'] = None
        return _state['library']


def available() -> bool:
    """Whether the compiled kernels load on this machine (built at the first call)."""
    return library() is not None
