"""SIGTERM, the preemption notice of cloud VMs and schedulers: noted for the savers (checkpoints.py SaveOnSigterm and
SaveOnPreemptionAcrossWorkers), and the process always ended within a bounded time.

This module imports no TensorFlow: the commands import it and take SIGTERM over before TensorFlow starts threads.

Python runs a signal handler only in the main thread, between two bytecodes: while the main thread waits inside
TensorFlow (a step whose input has stalled, a MultiWorkerMirroredStrategy waiting for its peers), a handler set
with signal.signal does not run at all, and TensorFlow's coordination service installs a C++ SIGTERM handler of
its own that only logs the signal. So the commands take SIGTERM away from every thread as the process starts
(listen, before TensorFlow starts any thread: the mask is inherited) and receive it in a thread of their own
(signal.sigwait), which:

- notes the request (requested()): a training run saves at its next step end and stops (checkpoints.py);
- passes the signal on to a Python handler another library installed (TensorFlow's
  PreemptionCheckpointHandler, which agrees on the step every worker saves);
- after the grace period (set_grace: 0 until training starts, then --termination_grace_seconds), if the process
  has not ended yet, prints one ``error:`` line and exits with status 143 (128 + SIGTERM). Checkpoints are written
  under temporary names and renamed when complete, so the last one written stays intact.

A program that calls train.train_and_evaluate itself gets the same within training (during_training) through
signal.signal and signal.set_wakeup_fd, whose file descriptor Python's C handler writes even while the main
thread is busy; a library that installed its own C handler takes the signal from it there.

Child processes inherit the blocked mask: start them with restore_mask() as preexec_fn (the commands start none).
"""

import contextlib
import os
import signal
import threading
import time

EXIT_STATUS = 128 + signal.SIGTERM

_requested = threading.Event()
_lock = threading.Lock()
_state = {'listening': False, 'watching': 0, 'grace': 0.0, 'what': '', 'deadline': None, 'saving': 0,
          'host_call': 0.0, 'signal': signal.SIGTERM, 'stderr': 2}
# What the commands take over (listen): the preemption notice, and Ctrl-C, which saves and stops the same way
# (a second Ctrl-C ends the process at once).
SIGNALS = {signal.SIGTERM, signal.SIGINT}
# The deadline waits at least this many of the last host call's duration: Keras runs callbacks (and so the save
# on SIGTERM) only between host calls, which last steps_per_execution steps (tf_keras training.py 1436-1441).
HOST_CALLS_OF_GRACE = 1.5


def requested() -> bool:
    """Whether SIGTERM (or, under listen, Ctrl-C) has arrived."""
    return _requested.is_set()


def signal_name() -> str:
    """The name of the signal that asked the run to stop ('SIGTERM' or 'SIGINT')."""
    return signal.Signals(_state['signal']).name


def exit_status() -> int:
    """The status a process stopped by that signal exits with: 143 for SIGTERM, 130 for SIGINT (Ctrl-C)."""
    return 128 + int(_state['signal'])


def set_grace(seconds: float, what: str) -> None:
    """From now on, SIGTERM ends the process ``seconds`` after it arrives if it has not ended by itself;
    ``what`` names what would be cut short (in the exit line)."""
    with _lock:
        _state['grace'], _state['what'] = float(seconds), what


def note_host_call(seconds: float) -> None:
    """The last host call (steps_per_execution training steps) took ``seconds``: SIGTERM's deadline is at least
    HOST_CALLS_OF_GRACE of it, so a call under way when the signal arrives can end and be saved."""
    with _lock:
        _state['host_call'] = max(0.0, float(seconds))


@contextlib.contextmanager
def saving():
    """Within the block a checkpoint is being written: SIGTERM's deadline does not cut it short (it waits for
    the block to end), so the save a SIGTERM asked for, or one already under way, completes."""
    with _lock:
        _state['saving'] += 1
    try:
        yield
    finally:
        with _lock:
            _state['saving'] -= 1


def effective_grace() -> float:
    """Seconds after SIGTERM before the process is ended: the grace set, or HOST_CALLS_OF_GRACE of the last
    host call if longer (0 stays 0: nothing to wait for before training starts)."""
    with _lock:
        grace, host_call = _state['grace'], _state['host_call']
    return grace if grace <= 0 else max(grace, HOST_CALLS_OF_GRACE * host_call)


def active() -> bool:
    """Whether SIGTERM is being watched for (listen, or inside during_training)."""
    return _state['listening'] or _state['watching'] > 0


def _exit_line(grace: float, what: str) -> str:
    name = signal_name()
    if grace <= 0:
        return f'error: stopped by {name}{f" ({what})" if what else ""}\n'
    return (f'error: {name}: {what} did not stop within {grace:g} s (--termination_grace_seconds, or 1.5 host '
            'calls if longer; a stalled input or a peer that does not answer); exiting without saving: the '
            'checkpoints written so far are intact\n')


def _deadline() -> None:
    """Exits the process once the grace period after SIGTERM has passed (effective_grace) and no checkpoint is
    being written."""
    started = time.monotonic()
    while True:
        grace = effective_grace()
        with _lock:
            what, busy = _state['what'], _state['saving'] > 0
        if time.monotonic() - started >= grace and not busy:
            break
        time.sleep(min(0.2, max(0.01, grace - (time.monotonic() - started))))
    os.write(_state['stderr'], _exit_line(grace, what).encode())
    os._exit(exit_status())  # pylint: disable=protected-access  (the main thread may be stuck in TensorFlow)


def _received(frame=None, signum: int = signal.SIGTERM) -> None:
    """SIGTERM (or Ctrl-C) arrived (in whichever thread noticed it first): note it and start the deadline once.
    A second Ctrl-C ends the process at once."""
    with _lock:
        first = _state['deadline'] is None
        if first:
            _state['signal'] = signum
            _state['deadline'] = threading.Thread(target=_deadline, name='sigterm-deadline', daemon=True)
    if not first and signum == signal.SIGINT:
        os.write(_state['stderr'], b'error: interrupted twice (Ctrl-C); exiting without saving: the checkpoints '
                                   b'written so far are intact\n')
        os._exit(128 + signal.SIGINT)  # pylint: disable=protected-access
    _requested.set()
    if first:
        _state['deadline'].start()


def _wait_for_sigterm() -> None:
    while True:
        signum = signal.sigwait(SIGNALS)
        _received(signum=signum)
        handler = signal.getsignal(signal.SIGTERM)
        if signum == signal.SIGTERM and callable(handler) and handler is not _python_handler:
            handler(signal.SIGTERM, None)   # e.g. TensorFlow's PreemptionCheckpointHandler: it only sets events


def listen() -> None:
    """Takes SIGTERM and SIGINT (Ctrl-C) away from every thread of this process (call it in the main thread before
    TensorFlow starts threads) and receives them in a thread of its own (module docstring). Idempotent."""
    if _state['listening'] or threading.current_thread() is not threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:    # the exit line goes to the real stderr also while TensorFlow's start-up output is held back (runtime.py)
        _state['stderr'] = os.dup(2)
    except OSError:
        pass
    threading.Thread(target=_wait_for_sigterm, name='sigterm', daemon=True).start()
    _state['listening'] = True


def restore_mask() -> None:
    """Unblocks SIGTERM and SIGINT (for a child process started from a listening one)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _python_handler(signum, frame):
    _received(frame)


def _watch_wakeup(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            _received()


@contextlib.contextmanager
def during_training(grace_seconds: float, what: str = 'training'):
    """Within the block, SIGTERM is noted (requested()) and ends the process ``grace_seconds`` later if it has
    not ended. Under listen() this only sets the grace; else (a program calling train_and_evaluate) it installs
    a handler and a wakeup descriptor for the block, in the main thread only, and restores the previous ones."""
    with _lock:
        previous_grace, previous_what = _state['grace'], _state['what']
    set_grace(grace_seconds, what)
    if active() or threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            set_grace(previous_grace, previous_what)
        return
    _state['watching'] += 1
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_handler = signal.signal(signal.SIGTERM, _python_handler)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_wakeup, args=(read_fd,), name='sigterm-wakeup', daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous_handler)
        os.close(write_fd)          # ends the watching thread
        _state['watching'] -= 1
        set_grace(previous_grace, previous_what)

