"""tools/benchmarks/step_timing.py: the benchmarks' round order and round-by-round ratios, against a machine
whose speed drifts."""

import os
import statistics
import sys

import tensorflow as tf

import helpers

sys.path.insert(0, os.path.join(helpers.REPO, 'tools', 'benchmarks'))
import step_timing  # pylint: disable=wrong-import-position


class RoundOrderTest(tf.test.TestCase):

    def test_every_other_round_is_reversed(self):
        self.assertEqual([step_timing.round_order(['a', 'b', 'c'], r) for r in range(3)],
                         [['a', 'b', 'c'], ['c', 'b', 'a'], ['a', 'b', 'c']])
        self.assertEqual(step_timing.round_order({'ours': 1, 'tfm': 2}, 1), ['tfm', 'ours'])

    def test_a_drifting_machine_favours_neither_of_two_equal_candidates(self):
        # Two candidates of the same speed on a machine 2% faster with every run: in the given order each
        # round, the second always looks faster; in the balanced order the round-by-round ratio is exact.
        def measure(order_of):
            figures, clock = {'a': [], 'b': []}, 0
            for round_index in range(4):
                for name in order_of(round_index):
                    figures[name].append(100.0 * 1.02 ** clock)
                    clock += 1
            return figures

        fixed = measure(lambda r: ['a', 'b'])
        self.assertLess(statistics.median(fixed['a']) / statistics.median(fixed['b']), 0.99)
        self.assertAlmostEqual(step_timing.paired_ratios(fixed, 'b')['a'], 1 / 1.02)
        balanced = measure(lambda r: step_timing.round_order(['a', 'b'], r))
        self.assertAlmostEqual(step_timing.paired_ratios(balanced, 'b')['a'], 1.0, delta=1e-12)
        self.assertAlmostEqual(step_timing.paired_ratios(balanced, 'b')['b'], 1.0)


if __name__ == '__main__':
    tf.test.main()
