"""Starts a tf.data service on this machine: a dispatcher and N workers, each its own process.

    python tools/launch/run_data_service.py --num_workers=2 --port=5050
    imagenet-tpu-train ... --data_service=grpc://localhost:5050       (in another shell)

Each process is `python -m imagenet_tpu.commands.data_service dispatcher|worker ...`; output lines are prefixed with
[dispatcher] or [worker I], and with --logs=DIR each process also writes DIR/dispatcher.log, DIR/worker-I.log.
Ctrl-C (or SIGTERM) stops them all; if one of them exits, the others are stopped and its exit status is
returned. On several machines, run the dispatcher on one and workers on the others (README.md, "Input on a
tf.data service").

The servers are named localhost here, but TensorFlow's tf.data servers listen on every interface of the machine
and authenticate no one (imagenet_tpu/commands/data_service.py cites the source): on a machine that other hosts
can reach, firewall the ports (BUILD.md, "The tf.data service on a network").
"""

import os
import signal
import subprocess
import sys
import threading
import time


from absl import app, flags  # noqa: E402

from imagenet_tpu.distribute import cluster  # noqa: E402

_NUM_WORKERS = flags.DEFINE_integer('num_workers', 2, 'Worker processes.')
_PORT = flags.DEFINE_integer('port', 5050, 'Dispatcher port (0: a free one).')
_WORKER_TIMEOUT_MS = flags.DEFINE_integer('worker_timeout_ms', 0, 'The dispatcher drops a worker silent this long '
                                          "(0: TensorFlow's default).")
_LOGS = flags.DEFINE_string('logs', None, 'Also write each process\'s output to a file in this folder.')


def _command(*args) -> list:
    return [sys.executable, '-m', 'imagenet_tpu.commands.data_service', *args]


def _start(name: str, command: list, log_dir, threads: list) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = os.path.join(log_dir, f'{name.replace(" ", "-")}.log') if log_dir else None
    thread = threading.Thread(target=cluster.forward_output, args=(process.stdout, f'[{name}]', log), daemon=True)
    thread.start()
    threads.append(thread)
    print(f'{name} pid {process.pid}', flush=True)
    return process


def run_service(num_workers: int, port: int, worker_timeout_ms: int = 0, log_dir=None) -> int:
    """Runs the dispatcher and workers until Ctrl-C/SIGTERM (returns 0) or until one of them exits (returns its
    status, 128 + N for signal N)."""
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    port = port or cluster.free_ports(1)[0]
    threads = []
    processes = [_start('dispatcher', _command('dispatcher', f'--port={port}', '--host=localhost',
                                               f'--worker_timeout_ms={worker_timeout_ms}'), log_dir, threads)]
    processes += [_start(f'worker {index}', _command('worker', f'--dispatcher=localhost:{port}', '--host=localhost'),
                         log_dir, threads) for index in range(num_workers)]
    print(f'tf.data service: --data_service=grpc://localhost:{port} ({num_workers} '
          f'worker{"s" if num_workers != 1 else ""})', flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    status = 0
    try:
        while not stopping.is_set():
            ended = [process for process in processes if process.poll() is not None]
            if ended:
                status = ended[0].returncode
                name = 'dispatcher' if ended[0] is processes[0] else f'worker {processes.index(ended[0]) - 1}'
                print(f'{name} exited with status {status}; stopping the others', flush=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C does not cut the clean stop short
    cluster.stop_processes(processes)
    for thread in threads:
        thread.join(timeout=5)
    return 128 - status if status < 0 else status


def main(argv):
    if len(argv) > 1:
        print(f'error: unexpected arguments: {" ".join(argv[1:])}', file=sys.stderr)
        return 2
    return run_service(_NUM_WORKERS.value, _PORT.value, _WORKER_TIMEOUT_MS.value, _LOGS.value)


if __name__ == '__main__':
    app.run(main)
