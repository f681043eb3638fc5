"""What the CPU tuners measured, kept per machine, so that a resumed or repeated run does not time again.

The convolution and batch-norm tuners (convolution.py, batch_norm.py) time their formulations once per shape on
the machine they run on. Their choices are written to a cache file named by the machine: the CPU's model, family,
model number and flags (/proc/cpuinfo), the TensorFlow version, whether oneDNN is on and the threads TensorFlow
uses, so that a file never answers for another machine or setting. The folder is ``$IMAGENET_TPU_CACHE``, else
``$XDG_CACHE_HOME/imagenet_tpu``, else ``~/.cache/imagenet_tpu``; ``IMAGENET_TPU_CACHE=off`` keeps nothing.
A file that cannot be read, is not the cache's JSON, or names another machine is ignored with one line (the
shapes are timed again and the file rewritten); one that cannot be written leaves the run untimed next time only.
"""

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Optional

from imagenet_tpu import runtime

# 2: batch norm timed over 10 alternating runs (3 before) and on maps from 200,000 elements (a million before):
# files of format 1 are timed again.
# 3: batch norm's choices made against Keras's fused kernel for every timed shape (before: against matrix-product
# statistics where no ReLU follows), so that files of format 2 are timed again.
# 4: convolutions of larger filters also timed as matrix products of their patches ('im2col'), so that the
# choices of format 3, made without them, are timed again.
# 5: the input gradient of strided 1x1 convolutions also timed as a matrix product ('matmul').
# 6: the filter gradient of 1x1 convolutions also timed as the swapped product ('matmul_swapped'), and patches
# ('im2col') taken as slices.
# 7: every convolution formulation timed as a tf.function rather than eagerly (docs/benchmarks.md C19): choices of
# format 6 and before, made eagerly, are timed again.
# 8: batch norm also timed with our own kernels ('native', native.py), so that choices of format 7, made without
# them, are timed again.
# 9: 3x3 stride-1 SAME convolutions also timed by Winograd's F(2x2, 3x3) ('winograd', kernels/winograd.cc), so
# that choices of format 8, made without it, are timed again.
FORMAT = 9
ENVIRONMENT = 'IMAGENET_TPU_CACHE'


def shortest_in_turns(runs: Dict[str, Callable[[], Any]], repeats: int) -> Dict[str, float]:
    """Seconds of the shortest of ``repeats`` timed calls of each of ``runs`` (each call does all its work,
    results fetched), after one call each that builds the kernels. The runs take turns, call by call, so that a
    spell in which the machine runs slower (another process, a change of clock) falls on all of them rather than
    on one: timed one after the other, such a spell once made TensorFlow's convolution look 27% slower than it is
    and chose another formulation (docs/benchmarks.md C13)."""
    for run in runs.values():
        run()
    best = {name: float('inf') for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def machine() -> Dict[str, Any]:
    """What makes timings comparable: the CPU, TensorFlow's version, oneDNN and the thread counts."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    cpu = runtime.cpu_description()
    return {'cpu': cpu['model'], 'cpu_family': cpu['family'], 'cpu_model_number': cpu['model_number'],
            'cpu_flags': hashlib.sha1(cpu['flags'].encode()).hexdigest()[:16],
            'cpus': os.cpu_count(), 'tensorflow': tf.__version__,
            # Whether oneDNN runs, not how it was asked for: TF_ENABLE_ONEDNN_OPTS=1 and TensorFlow's own default
            # on an AVX-512 CPU give the same kernels and share one file.
            'onednn': runtime.onednn_enabled(),
            'intra_op_threads': tf.config.threading.get_intra_op_parallelism_threads(),
            'inter_op_threads': tf.config.threading.get_inter_op_parallelism_threads()}


def folder() -> Optional[str]:
    """The cache folder, None when caching is off."""
    chosen = os.environ.get(ENVIRONMENT)
    if chosen:
        return None if chosen.lower() in ('off', 'none', '0') else chosen
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'imagenet_tpu')


def _warn(message: str) -> None:
    print(f'warning: {message}', file=sys.stderr, flush=True)


class Cache:
    """{kind: {shape key: choice}} of this machine, read from its file on first use and written at each put."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: Optional[Dict[str, Dict[str, Any]]] = None
        self._machine: Optional[Dict[str, Any]] = None
        self.path: Optional[str] = None

    def _load(self) -> None:
        if self._entries is not None:
            return
        self._entries, self._machine = {}, machine()
        base = folder()
        if base is None:
            return
        key = hashlib.sha1(json.dumps(self._machine, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(base, f'tuning-{key}.json')
        try:
            with open(self.path) as f:
                content = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError, UnicodeDecodeError) as error:
            _warn(f'ignoring the tuning cache {self.path} ({type(error).__name__}): timing again')
            return
        if not (isinstance(content, dict) and content.get('format') == FORMAT
                and content.get('machine') == self._machine and isinstance(content.get('entries'), dict)
                and all(isinstance(value, dict) for value in content['entries'].values())):
            _warn(f'ignoring the tuning cache {self.path} (written by another version or for another machine): '
                  'timing again')
            return
        self._entries = content['entries']

    def get(self, kind: str, key: str) -> Any:
        with self._lock:
            self._load()
            return self._entries.get(kind, {}).get(key)

    def put(self, kind: str, key: str, value: Any) -> None:
        with self._lock:
            self._load()
            self._entries.setdefault(kind, {})[key] = value
            if self.path is None:
                return
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                descriptor, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix='.tuning-')
                with os.fdopen(descriptor, 'w') as f:
                    json.dump({'format': FORMAT, 'machine': self._machine, 'entries': self._entries}, f, indent=1,
                              sort_keys=True)
                os.replace(temporary, self.path)
            except OSError as error:
                _warn(f'cannot write the tuning cache {self.path} ({error.strerror or type(error).__name__}); '
                      'the next run times again')
                self.path = None

    def reset(self) -> None:
        """Forgets what was read (the next get reads the file again)."""
        with self._lock:
            self._entries, self._machine, self.path = None, None, None


CACHE = Cache()
