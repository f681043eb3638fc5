"""The planner against every published MLPerf ResNet-50 result it has (imagenet_tpu/plan/published.py): for each
run its chips, batch, published minutes and images/s, the planner's, and the error; then the median and largest
error over the runs not used for calibration. --fit refits the two calibrated terms on the two calibration runs.

    python tools/benchmarks/plan_vs_published.py [--fit] [--markdown]
"""

import statistics

from absl import app, flags

from imagenet_tpu.model import resnet
from imagenet_tpu.plan import costs, model, published

_FIT = flags.DEFINE_bool('fit', False, 'Refit COMPUTE_EFFICIENCY and STEP_OVERHEAD_SECONDS on the calibration runs.')
_MARKDOWN = flags.DEFINE_bool('markdown', False, 'Print the table as Markdown (docs/benchmarks.md).')


def main(argv):
    del argv
    counted = costs.count(resnet.resnet(50, 1000, image_size=224))
    efficiency, overhead = model.COMPUTE_EFFICIENCY, model.STEP_OVERHEAD_SECONDS
    if _FIT.value:
        efficiency, overhead = published.fit(counted)
        print(f'fitted: COMPUTE_EFFICIENCY = {efficiency:.4f}, STEP_OVERHEAD_SECONDS = {overhead:.5f} '
              f'(in use: {model.COMPUTE_EFFICIENCY}, {model.STEP_OVERHEAD_SECONDS})')
    header = ['round', 'org', 'system', 'chips', 'batch', 'epochs', 'published min', 'published images/s',
              'predicted min', 'predicted images/s', 'error']
    if _MARKDOWN.value:
        print('| ' + ' | '.join(header) + ' |\n|' + '---|' * len(header))
    errors = []
    for run in published.RUNS:
        predicted = published.predict_minutes(run, counted, efficiency, overhead)
        error = predicted / run.minutes - 1
        calibration = (run.round, run.system) in published.CALIBRATION
        if not calibration:
            errors.append(error)
        implied = run.epochs * 1281167 / (run.minutes * 60)
        predicted_rate = run.epochs * 1281167 / (predicted * 60)
        cells = [run.round, run.org, run.system + (' (calibration)' if calibration else ''), f'{run.accelerators:,}',
                 f'{run.global_batch:,}', f'{run.epochs:g}', f'{run.minutes:.3f}', f'{implied:,.0f}',
                 f'{predicted:.3f}', f'{predicted_rate:,.0f}', f'{100 * error:+.0f}%']
        print(('| ' + ' | '.join(cells) + ' |') if _MARKDOWN.value else '  '.join(cells))
    print(f'\n{len(errors)} runs not used for calibration: median absolute error {100 * statistics.median(map(abs, errors)):.1f}%, '
          f'largest {100 * max(map(abs, errors)):.1f}%, {sum(abs(e) <= 0.4 for e in errors)} within 40%')


if __name__ == '__main__':
    app.run(main)
