"""TF_CONFIG for MultiWorkerMirroredStrategy: the cluster of workers and which one this process is; and the
process handling of the tools that start local clusters (run_local_workers.py, run_data_service.py).

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
