"""Runs the training command as N MultiWorkerMirroredStrategy workers on this machine (127.0.0.1).

    python tools/launch/run_local_workers.py --num_workers=2 -- --flagfile=flags/demo.cfg --strategy=multi_worker \
        --model_dir=runs/mw

Each worker is `python -m imagenet_tpu.commands.train ARGS` with its own TF_CONFIG (imagenet_tpu.distribute.cluster); output lines
are prefixed with [worker I]. If one worker fails or is killed, the others are stopped (a collective would
otherwise wait for it forever) and the exit status is the failed worker's. SIGTERM to a worker (preemption)
makes every worker save the same step and exit with status 143, which this launcher returns too. Running the
same command again resumes every worker from the chief's last checkpoint.
"""

import os
import subprocess
import sys
import threading
import time

from absl import app, flags

from imagenet_tpu.distribute import cluster


PREEMPTED = 143                  # a worker's status after SIGTERM to any worker: every worker saved, run again
PREEMPTION_GRACE_SECONDS = 60.0


def _wait(processes, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and any(process.poll() is None for process in processes):
        time.sleep(0.2)


def run_workers(num_workers: int, args: list, timeout_seconds: float = 0) -> int:
    """Starts the workers, waits for all; returns 0, or the status of the first that failed (124: timeout)."""
    workers = cluster.local_workers(num_workers)
    processes, threads = [], []
    for index in range(num_workers):
        environment = dict(os.environ, TF_CONFIG=cluster.tf_config(workers, index))
        process = subprocess.Popen([sys.executable, '-m', 'imagenet_tpu.commands.train', *args], env=environment,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        thread = threading.Thread(target=cluster.forward_output, args=(process.stdout, f'[worker {index}]'),
                                  daemon=True)
        thread.start()
        print(f'worker {index} pid {process.pid} at {workers[index]}', flush=True)
        processes.append(process)
        threads.append(thread)
    deadline = time.time() + timeout_seconds if timeout_seconds else None
    status = 0
    while any(process.poll() is None for process in processes):
        failed = [process for process in processes if process.poll() not in (None, 0)]
        if failed:
            status = failed[0].returncode
            index = processes.index(failed[0])
            if status == PREEMPTED:   # the others are saving the same step and will exit with it too
                print(f'worker {index} was preempted (status {status}); waiting for the others to save', flush=True)
                _wait(processes, PREEMPTION_GRACE_SECONDS)
            else:
                print(f'worker {index} exited with status {status}; stopping the others', flush=True)
            break
        if deadline and time.time() > deadline:
            status = 124
            print(f'timed out after {timeout_seconds:.0f} s; stopping the workers', flush=True)
            break
        time.sleep(0.2)
    cluster.stop_processes(processes)
    for thread in threads:
        thread.join(timeout=5)
    if not status:
        status = next((process.returncode for process in processes if process.returncode), 0)
    return 128 - status if status < 0 else status   # killed by signal N: 128 + N, as a shell reports it


def main(argv):
    if len(argv) < 2:
        print('error: give the training flags after --, e.g. -- --flagfile=flags/demo.cfg --strategy=multi_worker',
              file=sys.stderr)
        return 2
    return run_workers(_NUM_WORKERS.value, argv[1:], _TIMEOUT.value)


if __name__ == '__main__':
    _NUM_WORKERS = flags.DEFINE_integer('num_workers', 2, 'Worker processes to start.')
    _TIMEOUT = flags.DEFINE_float('timeout', 0, 'Stop every worker after this many seconds (0: no limit).')
    app.run(main)
