"""Shared by the benchmarks: time compiled Keras training steps of several models in alternating rounds.

Alternating rounds spread machine noise over every candidate alike, and every other round runs the candidates
in reverse order (A B C, C B A, A B C, ...): a machine whose speed drifts during a benchmark (seen: 1.4x faster
after 50 minutes on a shared 2-core host) then favours no candidate for being later in its round. Each figure is
the median over rounds of the mean step time within a round; ``paired_ratios`` also gives, for each candidate,
the median over rounds of its figure divided by the base's in the same round, which a slow drift affects least.
"""

import math
import statistics
import time

from imagenet_tpu import runtime  # before TensorFlow: the package's oneDNN setting (imagenet_tpu/runtime.py)

_ENVIRONMENT = {}


def environment(print_fn=print) -> dict:
    """The CPU, the features TensorFlow reports and the oneDNN setting in force, printed once. Every candidate
    of a step benchmark runs in this one process, so all of them run with that setting."""
    if not _ENVIRONMENT:
        _ENVIRONMENT.update(runtime.report())
        print_fn(runtime.describe(_ENVIRONMENT))
    return dict(_ENVIRONMENT)


def round_order(names, round_index: int) -> list:
    """The candidates in the order of round ``round_index`` (from 0): as given in even rounds, reversed in odd."""
    names = list(names)
    return names[::-1] if round_index % 2 else names


def paired_ratios(figures: dict, base: str) -> dict:
    """{name: median over rounds of figures[name][r] / figures[base][r]}: each round's ratio to the base, the
    drift between rounds left out. The median of the ratios' logarithms: a ratio and its inverse weigh alike, so
    with an even number of rounds the two middle ones meet at their geometric mean."""
    return {name: math.exp(statistics.median(math.log(value / figures[base][index])
                                             for index, value in enumerate(values)))
            for name, values in figures.items()}


def warm_up(classifier, iterator, steps: int = 2) -> None:
    """Builds and traces the train function, then runs ``steps`` steps untimed."""
    classifier.make_train_function()
    for _ in range(steps):
        logs = classifier.train_function(iterator)
    float(logs['loss'])


def time_rounds(runners: dict, steps: int, rounds: int, print_fn=print) -> dict:
    """runners: {name: (compiled classifier, iterator)} -> {name: [seconds per step in each round]}.

    One untimed round first: the first calls after every candidate has been traced were up to 18x slower than
    the rest here (ResNet-50 on 8 logical devices), whatever their order."""
    for classifier, iterator in runners.values():
        float(classifier.train_function(iterator)['loss'])
    times = {name: [] for name in runners}
    for round_index in range(rounds):
        for name in round_order(runners, round_index):
            classifier, iterator = runners[name]
            start = time.perf_counter()
            for _ in range(steps):
                logs = classifier.train_function(iterator)
            float(logs['loss'])  # waits for the last step
            times[name].append((time.perf_counter() - start) / steps)
        print_fn(f'round {round_index + 1}/{rounds}: '
                 + ', '.join(f'{name} {values[-1] * 1000:.0f} ms' for name, values in times.items()))
    return times


def summarize(times: dict, base: str, images_per_step: int, print_fn=print) -> dict:
    """Prints one line per candidate and returns {median_step_ms, images_per_second, step_time_ratio_to_BASE,
    paired_step_time_ratio_to_BASE}."""
    medians = {name: statistics.median(values) for name, values in times.items()}
    paired = paired_ratios(times, base)
    for name, median in medians.items():
        print_fn(f'{name}: {median * 1000:.1f} ms/step, {images_per_step / median:.1f} images/s, '
                 f'{median / medians[base]:.3f}x the step time of {base} (round by round: {paired[name]:.3f}x)')
    return {'environment': environment(print_fn),
            'median_step_ms': {n: round(m * 1000, 2) for n, m in medians.items()},
            'images_per_second': {n: round(images_per_step / m, 1) for n, m in medians.items()},
            f'step_time_ratio_to_{base}': {n: round(m / medians[base], 4) for n, m in medians.items()},
            f'paired_step_time_ratio_to_{base}': {n: round(r, 4) for n, r in paired.items()}}
