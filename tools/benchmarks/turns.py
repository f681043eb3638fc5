"""Training processes that take turns on the machine: all candidates start once and stay alive, one runs while the
others are stopped (SIGSTOP), and each turn is timed from the process's own progress reports.

Separate runs one after the other (benchmark_trainer's default) compare candidates minutes apart, each with its
own start-up; on a shared machine whose speed drifts by 1.6x within minutes, one slow interval then moves a whole
round. In turns, adjacent turns are a few seconds apart and no start-up or tracing is timed: after warming up,
each process alternates with the others every few reports, the order reversed every other round (A B, B A, ...).
A turn's first report closes the interval the pause cut, so it only starts the clock; the turn's figure is the
steps between its first and last report over the time between them. POSIX only (SIGSTOP and SIGCONT).

A training process keeps the speed it starts with: four identical ResNet-50 processes, taking turns, differed by
up to 14% in one round and kept their order across rounds (docs/benchmarks.md T25). So each candidate runs as
several processes (process_names), each taking its own turns, and a candidate's figure for a round is the mean
over its processes (by_candidate).
"""

import os
import re
import signal
import statistics
import subprocess
import threading
import time


class LiveRun:
    """One process whose progress reports (lines matching ``pattern``, group 1 the step) are timestamped by a
    thread as they arrive. Its own process group, so pausing reaches every process it starts."""

    def __init__(self, name: str, command: list, pattern, cwd=None, env=None):
        self.name, self.pattern = name, re.compile(pattern) if isinstance(pattern, str) else pattern
        self.reports, self.tail = [], []
        self._changed = threading.Condition()
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            now = time.perf_counter()
            with self._changed:
                self.tail = (self.tail + [line])[-30:]
                match = self.pattern.search(line)
                # Only increasing steps: orbit logs each line twice, our epoch-end line repeats the step.
                if match and int(match.group(1)) > (self.reports[-1][0] if self.reports else 0):
                    self.reports.append((int(match.group(1)), now))
                    self._changed.notify_all()
        self.process.wait()
        with self._changed:
            self._changed.notify_all()

    def wait_reports(self, count: int, timeout: float) -> list:
        """Waits for ``count`` reports after those seen so far; returns them as [(step, time)]. RuntimeError
        (with the process's last lines) if it exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            start = len(self.reports)
            while len(self.reports) < start + count:
                left = deadline - time.monotonic()
                if self.process.poll() is not None or left <= 0:
                    status = self.process.poll()
                    how = f'exited with status {status}' if status is not None else f'sent none for {timeout:.0f} s'
                    raise RuntimeError(f'{self.name} {how} after {len(self.reports)} progress reports; its last '
                                       f'lines:\n{"".join(self.tail)}')
                self._changed.wait(min(left, 1.0))
            return self.reports[start:start + count]

    def finish(self, on_report=None) -> int:
        """Waits for the process to end, calling ``on_report(step, time)`` for each report as it arrives (those
        seen before the call too); its exit status."""
        told = 0
        while True:
            with self._changed:
                while told == len(self.reports) and self._reader.is_alive():
                    self._changed.wait(1.0)
                fresh, told = self.reports[told:], len(self.reports)
                done = not self._reader.is_alive()
            for step, when in fresh:
                if on_report:
                    on_report(step, when)
            if done and told == len(self.reports):
                return self.process.wait()

    def _signal(self, number):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, number)
            except ProcessLookupError:
                pass

    def pause(self):
        self._signal(signal.SIGSTOP)

    def resume(self):
        self._signal(signal.SIGCONT)

    def end(self):
        """Kills the process group (a paused process too) and waits for it."""
        self._signal(signal.SIGKILL)
        self.process.wait()
        self._reader.join(timeout=10)


def turn_rate(reports: list, images_per_step: int) -> float:
    """images/s of one turn from its reports [(step, time)]: the first one starts the clock."""
    (first_step, first_time), (last_step, last_time) = reports[0], reports[-1]
    if last_step <= first_step or last_time <= first_time:
        raise ValueError(f'a turn needs two reports of increasing steps, got {reports}')
    return (last_step - first_step) * images_per_step / (last_time - first_time)


def steps_needed(report_every: int, rounds: int, turn_reports: int, warm_reports: int) -> int:
    """Training steps each process must have so that it never finishes before the last turn: its warm-up
    reports, each turn's reports plus the one that closes the cut interval, and two reports to spare."""
    return report_every * (warm_reports + rounds * (turn_reports + 1) + 2)


def process_names(candidates, processes: int) -> list:
    """'NAME#K' for K in 1..processes of every candidate, interleaved: a#1, b#1, a#2, b#2, ..."""
    return [f'{name}#{k}' for k in range(1, processes + 1) for name in candidates]


def candidate_of(process_name: str) -> str:
    """The candidate a process_names entry runs ('ours:--flag#2' -> 'ours:--flag')."""
    return process_name.rpartition('#')[0] or process_name


def by_candidate(rates: dict) -> dict:
    """{process name: [figure of each round]} -> {candidate: [mean over its processes, each round]}."""
    grouped = {}
    for name, values in rates.items():
        grouped.setdefault(candidate_of(name), []).append(values)
    return {name: [statistics.mean(round_values) for round_values in zip(*lists)] for name, lists in grouped.items()}


def take_turns(runs: dict, order, rounds: int, turn_reports: int, images_per_step: int, warm_reports: int = 2,
               timeout: float = 900.0, print_fn=print) -> dict:
    """runs: {name: callable() -> LiveRun, started when called}; order(names, round_index) -> the names in that
    round's order. Starts each in turn and lets it run ``warm_reports`` reports before pausing it (start-up and
    tracing never overlap another's turn), then gives each ``rounds`` turns of ``turn_reports`` timed report
    intervals. Returns {name: [images/s of each turn]}; every process is killed at the end, also on an error."""
    live = {}
    try:
        for name, start in runs.items():
            live[name] = start()
            live[name].wait_reports(warm_reports, timeout)
            live[name].pause()
        rates = {name: [] for name in runs}
        for round_index in range(rounds):
            for name in order(list(runs), round_index):
                run = live[name]
                run.resume()
                reports = run.wait_reports(turn_reports + 1, timeout)
                run.pause()
                rates[name].append(turn_rate(reports, images_per_step))
            print_fn(f'round {round_index + 1}/{rounds}: '
                     + ', '.join(f'{name} {values[-1]:.2f}' for name, values in rates.items()) + ' images/s')
        return rates
    finally:
        for run in live.values():
            run.end()
