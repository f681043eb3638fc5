"""TF_CONFIG for MultiWorkerMirroredStrategy: the cluster of workers and which one this process is, and its check
(check_tf_config); and the process handling of the tools that start local clusters (run_local_workers.py,
run_data_service.py).

    TF_CONFIG='{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'

Worker 0 is the chief: it writes checkpoints, TensorBoard logs and results (train.is_chief). Every worker runs
the same command with its own TF_CONFIG; tools/launch/run_local_workers.py does that on one machine.
"""

import json
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from imagenet_tpu.errors import ConfigError


def free_ports(count: int, host: str = '127.0.0.1') -> List[int]:
    """``count`` distinct TCP ports that are free on ``host`` now (the OS picks them)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_config(workers: Sequence[str], index: int) -> str:
    """The TF_CONFIG value (JSON) of worker ``index`` of ``workers`` ('host:port' each)."""
    if not 0 <= index < len(workers):
        raise ValueError(f'worker index {index} is outside the {len(workers)} workers')
    return json.dumps({'cluster': {'worker': list(workers)}, 'task': {'type': 'worker', 'index': index}})


# The jobs TensorFlow accepts in a cluster (tensorflow/python/distribute/multi_worker_util.py,
# _validate_cluster_spec); an evaluator task may be left out of the cluster.
TASK_TYPES = ('chief', 'worker', 'evaluator', 'ps')
EXAMPLE = '{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + '...'


def _count(value) -> Optional[int]:
    """``value`` as a task index (TensorFlow takes int(index): a digit string too); None if it is no count."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _job_indices(job: str, addresses) -> List[int]:
    """The task indices of a job of TF_CONFIG's cluster: a list of 'host:port' addresses, or TensorFlow's sparse
    form {"index": "host:port"}."""
    pairs = (list(enumerate(addresses)) if isinstance(addresses, list)
             else [(_count(index), address) for index, address in addresses.items()]
             if isinstance(addresses, dict) else [])
    if not pairs:
        raise ConfigError(f'TF_CONFIG job {job!r} must be a list of host:port addresses, got {_short(addresses)}')
    for index, address in pairs:
        host, _, port = address.rpartition(':') if isinstance(address, str) else ('', '', '')
        if index is None or not host or not port.isdigit():
            raise ConfigError(f'TF_CONFIG job {job!r} has {_short(address)}, not a host:port address')
    return [index for index, _ in pairs]


def check_tf_config(text: Optional[str]) -> None:
    """ConfigError in one line naming what is wrong with ``text``, a TF_CONFIG value, for
    MultiWorkerMirroredStrategy: not JSON, not an object with "cluster" and "task", a job that is no list of
    'host:port' addresses, or a task that is not in the cluster. Unset or empty is fine: one worker, this process
    alone. (TensorFlow reads TF_CONFIG without "cluster" as that too, silently, and fails with a traceback on
    the rest: tensorflow/python/distribute/multi_worker_util.py, _validate_cluster_spec.)"""
    if text is None or not text.strip():
        return
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ConfigError(f'TF_CONFIG is not JSON ({error}); expected e.g. {EXAMPLE}') from None
    if not isinstance(value, dict):
        raise ConfigError(f'TF_CONFIG is a JSON {type(value).__name__}, not an object; expected e.g. {EXAMPLE}')
    for key in ('cluster', 'task'):
        if key not in value:
            raise ConfigError(f'TF_CONFIG has no "{key}"; expected e.g. {EXAMPLE}')
    jobs, task = value['cluster'], value['task']
    if not isinstance(jobs, dict) or not jobs:
        raise ConfigError(f'TF_CONFIG "cluster" must map job names to lists of host:port addresses, got '
                          f'{_short(jobs)}')
    indices = {}
    for job, addresses in jobs.items():
        if job not in TASK_TYPES:
            raise ConfigError(f'TF_CONFIG "cluster" has a job {job!r}; jobs are {", ".join(TASK_TYPES)}')
        indices[job] = _job_indices(job, addresses)
    if not isinstance(task, dict) or 'type' not in task or 'index' not in task:
        raise ConfigError(f'TF_CONFIG "task" must be {{"type": JOB, "index": N}}, got {_short(task)}')
    kind, index = task['type'], _count(task['index'])
    if not isinstance(kind, str) or (kind not in jobs and kind != 'evaluator'):
        raise ConfigError(f'TF_CONFIG task type {_short(kind)} is not a job of its cluster ({", ".join(jobs)})')
    if index is None:
        raise ConfigError(f'TF_CONFIG task index {_short(task["index"])} is not a count (0, 1, ...)')
    if kind in jobs and index not in indices[kind]:
        count = len(indices[kind])
        raise ConfigError(f'TF_CONFIG task index {index} is outside the cluster: {kind} has {count} task'
                          + (f' (index {indices[kind][0]})' if count == 1 else
                             f's (indices {", ".join(str(i) for i in sorted(indices[kind]))})'))


def tasks(text: Optional[str]):
    """(this task's 'host:port', the other tasks' addresses) of a checked TF_CONFIG value; None without a
    cluster of several tasks."""
    if not text or not text.strip():
        return None
    value = json.loads(text)
    addresses = {}
    for job, members in value['cluster'].items():
        pairs = enumerate(members) if isinstance(members, list) else ((_count(i), a) for i, a in members.items())
        addresses.update({(job, index): address for index, address in pairs})
    own = addresses.pop((value['task']['type'], _count(value['task']['index'])), None)
    if own is None or not addresses:
        return None
    return own, sorted(addresses.values())


def _reachable(address: str, timeout: float) -> bool:
    host, _, port = address.rpartition(':')
    try:
        with socket.create_connection((host.strip('[]'), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_peers(text: Optional[str], print_fn=print, report_seconds: float = 30.0, poll_seconds: float = 0.5,
                   timeout_seconds: Optional[float] = None) -> None:
    """Returns once every other task of the cluster TF_CONFIG ``text`` describes accepts connections at its
    address; before that, this task accepts connections at its own (each task waits for the others, and nobody
    waits for a task that waits).

    TensorFlow's own wait for the other tasks (in MultiWorkerMirroredStrategy's start) holds Python's global lock
    inside TensorFlow and installs a SIGTERM handler that only logs: a worker whose peers never come could not be
    stopped by SIGTERM. This wait is Python's, a socket at a time, so SIGTERM ends it (termination.py). A task
    that passed it has closed its listener and TensorFlow's server listens on the same port: reachable too.
    Prints a line at once and then every ``report_seconds`` naming the tasks not yet there."""
    found = tasks(text)
    if found is None:
        return
    own, others = found
    _, _, port = own.rpartition(':')
    listener = socket.socket(socket.AF_INET6 if ':' in own.rpartition(':')[0] else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(('', int(port)))
        listener.listen(64)
    except OSError as error:
        listener.close()
        raise ConfigError(f'cannot listen at {own}, this task\'s address in TF_CONFIG ({error.strerror}): is '
                          'another process using the port?') from None
    listener.settimeout(0)
    started = time.monotonic()
    reported = started - report_seconds        # the first line at once
    missing = list(others)
    try:
        while missing:
            missing = [address for address in missing if not _reachable(address, poll_seconds)]
            while True:                 # accept (and close) the others' probes
                try:
                    connection, _ = listener.accept()
                    connection.close()
                except (BlockingIOError, InterruptedError):
                    break
            now = time.monotonic()
            if missing and timeout_seconds is not None and now - started > timeout_seconds:
                raise ConfigError(f'the other tasks of TF_CONFIG did not start within {timeout_seconds:g} s: '
                                  + ', '.join(missing))
            if missing and now - reported >= report_seconds:
                print_fn(f'waiting for {len(missing)} of the {len(others)} other tasks of TF_CONFIG to start '
                         f'({", ".join(missing[:4])}{", ..." if len(missing) > 4 else ""}) for {now - started:.0f} s')
                reported = now
            if missing:
                time.sleep(poll_seconds)
    finally:
        listener.close()


def local_workers(count: int, host: str = '127.0.0.1') -> List[str]:
    """Addresses of ``count`` workers on this machine, each on a free port."""
    return [f'{host}:{port}' for port in free_ports(count, host)]


def forward_output(stream, prefix: str, log_path: Optional[str] = None) -> None:
    """Copies a child's output lines to ours with ``prefix`` (and, without it, to ``log_path``) until it ends."""
    log = open(log_path, 'w') if log_path else None   # pylint: disable=consider-using-with
    try:
        for line in iter(stream.readline, ''):
            sys.stdout.write(f'{prefix} {line}')
            sys.stdout.flush()
            if log:
                log.write(line)
                log.flush()
    finally:
        if log:
            log.close()


def stop_processes(processes, grace_seconds: float = 10.0) -> None:
    """SIGTERM to every running process, then SIGKILL to those still running after ``grace_seconds``."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_seconds
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
