"""tools/benchmarks/turns.py: processes that take turns on the machine, each paused while another runs, timed from
their own progress reports. Checked with small processes that report at known rates."""

import os
import signal
import sys
import time
import unittest

import tensorflow as tf

import helpers

sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'benchmarks'))
import step_timing  # pylint: disable=wrong-import-position
import turns  # pylint: disable=wrong-import-position

REPORT = r'^step (\d+) '
# Reports one step every PERIOD seconds, up to STEPS, then exits.
FAKE_TRAINER = '''
import sys, time
period, steps = float(sys.argv[1]), int(sys.argv[2])
for step in range(1, steps + 1):
    time.sleep(period)
    print(f"step {step} ", flush=True)
'''


def fake(name, period, steps):
    return lambda: turns.LiveRun(name, [sys.executable, '-c', FAKE_TRAINER, str(period), str(steps)], REPORT)


@unittest.skipUnless(hasattr(signal, 'SIGSTOP'), 'needs SIGSTOP and SIGCONT (POSIX)')
class TakeTurnsTest(tf.test.TestCase):

    def test_rates_follow_the_processes_speeds_and_only_one_runs_at_a_time(self):
        rounds, turn_reports, warm = 2, 3, 2
        steps = turns.steps_needed(1, rounds, turn_reports, warm)
        started = {}

        def keep(name, start):
            def run():
                started[name] = start()
                return started[name]
            return run

        # 'fast' reports every 0.05 s, 'slow' every 0.15 s: 3x the steps per second, at 1 image a step.
        rates = turns.take_turns({'fast': keep('fast', fake('fast', 0.05, steps)),
                                  'slow': keep('slow', fake('slow', 0.15, steps))},
                                 step_timing.round_order, rounds, turn_reports, images_per_step=1, warm_reports=warm,
                                 timeout=60, print_fn=lambda line: None)
        self.assertEqual({name: len(values) for name, values in rates.items()}, {'fast': rounds, 'slow': rounds})
        for fast, slow in zip(rates['fast'], rates['slow']):
            self.assertBetween(fast, 10.0, 20.5)     # 20 steps/s at most; sleep overshoots on a busy machine
            self.assertBetween(fast / slow, 2.0, 4.0)
        # Every report in time order: each process's warm-up, then one block per turn (the turn's reports plus
        # the one that closes the interval cut by the pause), never a report of the paused one in between.
        timeline = sorted((when, name) for name, run in started.items() for _, when in run.reports)
        names = [name for _, name in timeline]
        expected = ['fast'] * warm + ['slow'] * warm
        for round_index in range(rounds):
            for name in step_timing.round_order(['fast', 'slow'], round_index):
                expected += [name] * (turn_reports + 1)
        self.assertEqual(names, expected)
        for run in started.values():       # every process was ended
            self.assertIsNotNone(run.process.poll())

    def test_a_process_with_too_few_steps_stops_the_turns_with_its_last_lines(self):
        rounds, turn_reports, warm = 2, 2, 2
        enough = turns.steps_needed(1, rounds, turn_reports, warm)
        # One turn short: it exits before its last turn ends.
        short = enough - 2 - (turn_reports + 1)
        with self.assertRaisesRegex(RuntimeError, r'short exited with status 0 after .* progress reports; '
                                                  r'its last lines:\nstep'):
            turns.take_turns({'long': fake('long', 0.02, enough), 'short': fake('short', 0.02, short)},
                             step_timing.round_order, rounds, turn_reports, images_per_step=1, warm_reports=warm,
                             timeout=60, print_fn=lambda line: None)

    def test_a_silent_process_times_out_and_is_ended(self):
        started = {}

        def silent():
            started['run'] = turns.LiveRun('silent', [sys.executable, '-c', 'import time; time.sleep(60)'],
                                           REPORT)
            return started['run']

        begun = time.monotonic()
        with self.assertRaisesRegex(RuntimeError, 'silent sent none for 1 s after 0 progress reports'):
            turns.take_turns({'silent': silent}, step_timing.round_order, 1, 1, images_per_step=1, timeout=1,
                             print_fn=lambda line: None)
        self.assertLess(time.monotonic() - begun, 30)
        self.assertIsNotNone(started['run'].process.poll())


class FinishTest(tf.test.TestCase):

    def test_every_report_is_passed_on_once_in_order_and_the_exit_status_returned(self):
        # Reports every 0.05 s, then exits with status 3; some reports arrive before finish is called.
        run = turns.LiveRun('fake', [sys.executable, '-c', FAKE_TRAINER + 'sys.exit(3)\n', '0.05', '12'], REPORT)
        run.wait_reports(2, timeout=60)
        seen = []
        self.assertEqual(run.finish(lambda step, when: seen.append((step, when))), 3)
        self.assertEqual([step for step, _ in seen], list(range(1, 13)))
        self.assertEqual(seen, run.reports)
        self.assertEqual(sorted(when for _, when in seen), [when for _, when in seen])
        run.end()         # after its end: nothing to signal


class ProcessesPerCandidateTest(tf.test.TestCase):

    def test_names_interleave_candidates_and_map_back(self):
        names = turns.process_names(['ours', 'tfm', 'ours:--steps_per_execution=10'], 2)
        self.assertEqual(names, ['ours#1', 'tfm#1', 'ours:--steps_per_execution=10#1',
                                 'ours#2', 'tfm#2', 'ours:--steps_per_execution=10#2'])
        self.assertEqual([turns.candidate_of(n) for n in names[:3]], ['ours', 'tfm', 'ours:--steps_per_execution=10'])
        self.assertEqual(turns.candidate_of('ours'), 'ours')

    def test_a_round_of_a_candidate_is_the_mean_over_its_processes(self):
        rates = {'a#1': [10.0, 12.0, 11.0], 'b#1': [20.0, 21.0, 19.0], 'a#2': [14.0, 16.0, 13.0]}
        combined = turns.by_candidate(rates)
        self.assertEqual(sorted(combined), ['a', 'b'])
        self.assertAllClose(combined['a'], [(10 + 14) / 2, (12 + 16) / 2, (11 + 13) / 2])
        self.assertAllClose(combined['b'], rates['b#1'])


class TurnRateTest(tf.test.TestCase):

    def test_the_first_report_only_starts_the_clock(self):
        # 10 steps between the first and last report, over 4 s, at 32 images a step.
        self.assertAllClose(turns.turn_rate([(5, 100.0), (10, 102.5), (15, 104.0)], 32), 10 * 32 / 4.0)

    def test_a_turn_without_progress_is_refused(self):
        with self.assertRaisesRegex(ValueError, 'two reports of increasing steps'):
            turns.turn_rate([(5, 1.0), (5, 2.0)], 32)


if __name__ == '__main__':
    tf.test.main()
