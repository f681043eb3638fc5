"""Shared by the benchmarks: time compiled Keras training steps of several models in alternating rounds.

Alternating rounds (A B C A B C ...) spread machine noise over every candidate alike; each figure is the median
over rounds of the mean step time within a round.
"""

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
        for name, (classifier, iterator) in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                logs = classifier.train_function(iterator)
            float(logs['loss'])  # waits for the last step
            times[name].append((time.perf_counter() - start) / steps)
        print_fn(f'round {round_index + 1}/{rounds}: '
                 + ', '.join(f'{name} {values[-1] * 1000:.0f} ms' for name, values in times.items()))
    return times


def summarize(times: dict, base: str, images_per_step: int, print_fn=print) -> dict:
    """Prints one line per candidate and returns {median_step_ms, images_per_second, step_time_ratio_to_BASE}."""
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print_fn(f'{name}: {median * 1000:.1f} ms/step, {images_per_step / median:.1f} images/s, '
                 f'{median / medians[base]:.3f}x the step time of {base}')
    return {'environment': environment(print_fn),
            'median_step_ms': {n: round(m * 1000, 2) for n, m in medians.items()},
            'images_per_second': {n: round(images_per_step / m, 1) for n, m in medians.items()},
            f'step_time_ratio_to_{base}': {n: round(m / medians[base], 4) for n, m in medians.items()}}
