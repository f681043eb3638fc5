"""TF_CONFIG for MultiWorkerMirroredStrategy: the cluster of workers and which one this process is, and its check
(check_tf_config); and the process handling of the tools that start local clusters (run_local_workers.py,
run_data_service.py).

    TF_CONFIG='{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'

Worker 0 is the chief: it writes checkpoints, TensorBoard logs and results (checkpoints.is_chief). Every worker
runs the same command with its own TF_CONFIG; tools/launch/run_local_workers.py does that on one machine.

Under Slurm (``srun`` or an ``sbatch`` script's ``srun``), every task of the job step is a worker: the cluster
comes from Slurm's variables through TensorFlow's SlurmClusterResolver (slurm_tf_config), task i at port
--cluster_port + its index on its node, and each task's GPUs are those Slurm bound to it (--gpus-per-task), or
else its share of the node's GPUs.
"""

import json
import os
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


CLUSTER_SOURCES = ('auto', 'tf_config', 'slurm')
SLURM_TASK_VARIABLES = ('SLURM_PROCID', 'SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NODELIST', 'SLURM_STEP_TASKS_PER_NODE')


def under_slurm(environ=os.environ) -> bool:
    """Whether this process is a task of a Slurm job step (srun sets every SLURM_STEP_* variable read here)."""
    return all(name in environ for name in SLURM_TASK_VARIABLES)


def cluster_config(source: str, port: int = 8888, environ=os.environ) -> Optional[str]:
    """The TF_CONFIG value of this process for --cluster=``source``: 'tf_config' the variable itself, 'slurm' the
    cluster of the Slurm job step (slurm_tf_config), 'auto' TF_CONFIG when it is set, else Slurm's when under srun.
    ConfigError when 'slurm' is asked for outside a job step."""
    if source == 'tf_config' or (source == 'auto' and (environ.get('TF_CONFIG') or not under_slurm(environ))):
        return environ.get('TF_CONFIG')
    if not under_slurm(environ):
        missing = [name for name in SLURM_TASK_VARIABLES if name not in environ]
        raise ConfigError(f'--cluster=slurm outside a Slurm job step ({", ".join(missing)} not set): start the '
                          'command with srun')
    return slurm_tf_config(port)


def tasks_per_node(text: str) -> List[int]:
    """Slurm's SLURM_STEP_TASKS_PER_NODE ('2(x3),1': 2 tasks on each of 3 nodes, then 1) as [2, 2, 2, 1]."""
    counts = []
    for part in text.split(','):
        count, _, repeat = part.partition('(x')
        counts += [int(count)] * (int(repeat.rstrip(')')) if repeat else 1)
    return counts


def slurm_gpus(environ=os.environ):
    """(GPUs of each node, GPUs of each task, whether TensorFlow's resolver is to set CUDA_VISIBLE_DEVICES), for
    SlurmClusterResolver, as Slurm assigned the GPUs: with --gpus-per-task Slurm binds each task's GPUs itself
    (kept as they are); with GPUs for the node only (SLURM_GPUS_ON_NODE) the resolver gives each task its share;
    on nodes without GPUs each task counts one nominal device (the resolver divides by GPUs per task) and
    nothing is set."""
    most = max(tasks_per_node(environ['SLURM_STEP_TASKS_PER_NODE']))
    per_task = environ.get('SLURM_GPUS_PER_TASK', '').rsplit(':', 1)[-1]   # '2' or 'a100:2'
    on_node = environ.get('SLURM_GPUS_ON_NODE', '').strip()
    if per_task.isdigit() and int(per_task) > 0:
        return int(per_task) * most, int(per_task), False
    if on_node.isdigit() and int(on_node) >= most:
        return int(on_node), int(on_node) // most, True
    return most, 1, False


def bind_slurm_gpus(environ=os.environ) -> str:
    """Gives this Slurm task its share of the node's GPUs in CUDA_VISIBLE_DEVICES before TensorFlow first lists its
    devices; returns the value set ('' when nothing is set). TensorFlow reads the variable once, when it lists
    the devices, and the commands list them at start (runtime.import_tensorflow): set later by
    SlurmClusterResolver (slurm_cluster_resolver.py 350-351), it would come too late and every task would place
    replicas on all of the node's GPUs (collective_all_reduce_strategy.py 403-417). Only where the resolver would
    set it (node GPUs shared by several tasks: slurm_gpus), outside a TF_CONFIG cluster, and never over a value
    Slurm bound itself; task j of its node takes GPUs j * per_task ... (j + 1) * per_task - 1, as the resolver
    allocates them (slurm_cluster_resolver.py 318-331)."""
    if environ.get('TF_CONFIG') or not under_slurm(environ) or environ.get('CUDA_VISIBLE_DEVICES'):
        return ''
    try:
        _, per_task, share = slurm_gpus(environ)
        local = int(environ.get('SLURM_LOCALID', ''))
    except (KeyError, ValueError):
        return ''
    if not share:
        return ''
    value = ','.join(str(gpu) for gpu in range(local * per_task, (local + 1) * per_task))
    environ['CUDA_VISIBLE_DEVICES'] = value
    return value


def slurm_tf_config(port: int = 8888) -> str:
    """The TF_CONFIG value of this Slurm task (from os.environ): every task of the step a worker, by TensorFlow's
    SlurmClusterResolver (SLURM_STEP_NODELIST expanded, tasks on each node at ``port`` + their index there, this
    task SLURM_PROCID). It may set CUDA_VISIBLE_DEVICES (slurm_gpus)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel  (TensorFlow only for a Slurm cluster)
    try:
        gpus_per_node, gpus_per_task, set_gpus = slurm_gpus()
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port, gpus_per_node=gpus_per_node, gpus_per_task=gpus_per_task, auto_set_gpu=set_gpus)
        workers = resolver.cluster_spec().as_dict()['worker']
    except (RuntimeError, ValueError, KeyError, OSError) as error:
        raise ConfigError(f'cannot make the cluster from Slurm\'s variables: {error}') from None
    return tf_config(workers, resolver.task_id)


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
    stopped by SIGTERM. This wait is Python's, a socket at a time, so SIGTERM ends it (preemption.py). A task
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
