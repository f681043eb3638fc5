"""Where a training step's time goes on a CPU: each network's step (benchmark_step.py's networks and step) runs in
a process of its own under oneDNN's execution log (ONEDNN_VERBOSE=profile_exec), and its oneDNN primitives are
summed per kind: convolutions forward, backward-data and backward-weights, matrix products, batch norm, weight
reorders, pooling. Convolutions and matrix products are also given in GFLOP/s (from the shapes the log names) and
as a fraction of the machine's float32 matrix-product peak (benchmark_step.matmul_peak_flops, measured in this
process); what the step's wall time holds beyond oneDNN's primitives is TensorFlow's own kernels (elementwise
ops, the optimizer's updates, sums) and the time between ops.

The step runs with one inter-op thread by default (--inter_op_threads), so that primitives do not run side by
side and each one's time is its own; the step itself is then slower than with TensorFlow's default, and the
logging adds to it. Compare networks by the rows, not by the step time: benchmark_step.py times steps.

    python tools/benchmarks/profile_step.py --models=ours,tf_models_official --top=15
"""

import collections
import json
import os
import re
import subprocess
import sys
import time

from absl import app, flags

import benchmark_step
import step_timing

_MARK = 'profile_step: timed steps start'
# The primitive kinds of oneDNN's log, and the name each gets here (others keep their own).
KINDS = {('convolution', 'forward_training'): 'convolution forward',
         ('convolution', 'forward_inference'): 'convolution forward',
         ('convolution', 'backward_data'): 'convolution backward-data',
         ('convolution', 'backward_weights'): 'convolution backward-weights',
         ('gemm_api', 'undef'): 'matrix product', ('matmul', 'forward_training'): 'matrix product',
         ('matmul', 'forward_inference'): 'matrix product', ('matmul', 'undef'): 'matrix product',
         ('batch_normalization', 'forward_training'): 'batch norm forward',
         ('batch_normalization', 'backward'): 'batch norm backward',
         ('reorder', 'undef'): 'reorder'}


def define_flags():
    benchmark_step.define_flags()
    flags.FLAGS.set_default('models', ['ours', 'tf_models_official'])
    flags.FLAGS.set_default('steps', 5)
    flags.DEFINE_integer('warmup_steps', 3, 'Untimed steps before the profiled ones.', lower_bound=1)
    flags.DEFINE_integer('inter_op_threads', 1, "TensorFlow's inter-op threads in the profiled process (0: "
                         "TensorFlow's default).", lower_bound=0)
    flags.DEFINE_integer('top', 10, 'Also list the N primitives of most time, with their shapes.', lower_bound=0)
    flags.DEFINE_string('child', None, 'Internal: profile this one model in this process.')


def primitive_flops(kind: str, shape: str) -> int:
    """FLOPs (2 per multiply-add) of one convolution or matrix product named in oneDNN's log; 0 for others.

    Convolution shapes read 'mb32_g1ic256oc256_ih8oh8kh3sh1dh0ph1_iw8ow8kw3sw1dw0pw1' (groups, depth only when
    present); matrix products 'MxK:KxN', with leading batch dimensions on both sides when batched."""
    if kind == 'convolution':
        sizes = dict(re.findall(r'(mb|g|ic|oc|od|oh|ow|kd|kh|kw)(\d+)', shape))
        product = 2 * int(sizes['mb']) * int(sizes['ic']) * int(sizes['oc']) // int(sizes.get('g', 1))
        for name in ('od', 'oh', 'ow', 'kd', 'kh', 'kw'):
            product *= int(sizes.get(name, 1))
        return product
    if kind in ('gemm_api', 'matmul'):
        left, right = (side.split('x') for side in shape.split(':'))
        product = 2 * int(right[-1])
        for size in left:
            product *= int(size)
        return product
    return 0


def parse_log(lines, steps: int) -> dict:
    """oneDNN execution-log lines after the mark -> per kind and per primitive: ms per step, GFLOP per step."""
    primitives = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for line in lines:
        parts = line.rstrip('\n').split(',')
        if len(parts) < 8 or not parts[0].endswith('_verbose') or parts[3] != 'exec':
            continue
        try:
            milliseconds = float(parts[-1])
        except ValueError:
            continue
        kind, implementation, propagation, shape = parts[5], parts[6], parts[7], parts[-2]
        name = KINDS.get((kind, propagation), f'{kind} {propagation}'.replace(' undef', ''))
        row = primitives[(name, implementation, shape)]
        row[0] += milliseconds / steps
        row[1] += primitive_flops(kind, shape) / 1e9 / steps
        row[2] += 1
    kinds = {}
    for (name, _, _), (ms, gflop, _) in primitives.items():
        total = kinds.setdefault(name, {'ms': 0.0, 'gflop': 0.0})
        total['ms'] += ms
        total['gflop'] += gflop
    return {'kinds': kinds,
            'primitives': [{'kind': name, 'implementation': implementation, 'shape': shape, 'ms': ms,
                            'gflop': gflop, 'per_step': count / steps}
                           for (name, implementation, shape), (ms, gflop, count) in primitives.items()]}


def run_child(name: str) -> None:
    """Builds and warms up one model, marks the log, runs --steps steps and prints their wall time as JSON."""
    import ctypes
    from imagenet_tpu.config import Config
    from imagenet_tpu.data import pipeline as input_pipeline
    f = flags.FLAGS
    classifier = benchmark_step.build_classifier(name, f.image_size, f.batch_size)
    iterator = iter(input_pipeline.synthetic_dataset(Config(image_size=f.image_size, global_batch_size=f.batch_size,
                                                            num_classes=1000)))
    step_timing.warm_up(classifier, iterator, steps=f.warmup_steps)
    ctypes.CDLL(None).fflush(None)        # oneDNN's lines so far, before the mark (they share stdout)
    sys.stdout.write(f'{_MARK}\n')
    sys.stdout.flush()
    started = time.perf_counter()
    for _ in range(f.steps):
        logs = classifier.train_function(iterator)
    float(logs['loss'])
    seconds = time.perf_counter() - started
    ctypes.CDLL(None).fflush(None)
    sys.stdout.write(json.dumps({'step_ms': seconds / f.steps * 1000}) + '\n')
    sys.stdout.flush()


def profile(name: str) -> dict:
    """Runs this file for model ``name`` in a child process under oneDNN's log; its parsed figures."""
    f = flags.FLAGS
    env = dict(os.environ, ONEDNN_VERBOSE='profile_exec', TF_CPP_MIN_LOG_LEVEL='2')
    if f.inter_op_threads:
        env['TF_NUM_INTEROP_THREADS'] = str(f.inter_op_threads)
    command = [sys.executable, os.path.abspath(__file__), f'--child={name}', f'--image_size={f.image_size}',
               f'--batch_size={f.batch_size}', f'--steps={f.steps}', f'--warmup_steps={f.warmup_steps}']
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.splitlines()
    tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
    if done.returncode and ('ImportError' in done.stderr or 'ModuleNotFoundError' in done.stderr):
        print(f'skipping {name}: {tail} (install the peer extra)')
        return None
    if done.returncode or _MARK not in lines or not lines[-1].startswith('{'):
        raise SystemExit(f'error: profiling {name} failed (exit status {done.returncode}): {tail}')
    figures = parse_log(lines[lines.index(_MARK) + 1:-1], f.steps)
    figures['step_ms'] = round(json.loads(lines[-1])['step_ms'], 1)
    return figures


def report(name: str, figures: dict, peak_flops: float, top: int, print_fn=print) -> None:
    step_ms = figures['step_ms']
    onednn_ms = sum(kind['ms'] for kind in figures['kinds'].values())
    print_fn(f'{name}: {step_ms:,.0f} ms a step under the log; oneDNN primitives {onednn_ms:,.0f} ms '
             f'({onednn_ms / step_ms:.0%}), the rest (TensorFlow kernels, time between ops) '
             f'{step_ms - onednn_ms:,.0f} ms')
    for kind, values in sorted(figures['kinds'].items(), key=lambda item: -item[1]['ms']):
        rate = ''
        if values['gflop']:
            gflops = values['gflop'] / values['ms'] * 1000
            rate = f', {values["gflop"]:.1f} GFLOP at {gflops:.0f} GFLOP/s'
            if peak_flops:
                rate += f' ({gflops * 1e9 / peak_flops:.0%} of the peak)'
        print_fn(f'  {kind:30s} {values["ms"]:8.1f} ms  {values["ms"] / step_ms:5.1%}{rate}')
    for row in sorted(figures['primitives'], key=lambda row: -row['ms'])[:top]:
        rate = f'{row["gflop"] / row["ms"] * 1000:5.0f} GFLOP/s' if row['gflop'] else ' ' * 13
        print_fn(f'    {row["ms"]:7.1f} ms  {rate}  x{row["per_step"]:<4g} {row["kind"]:28s} {row["shape"]}'
                 f'  ({row["implementation"]})')


def main(argv):
    del argv
    f = flags.FLAGS
    if f.child:
        run_child(f.child)
        return
    environment = step_timing.environment()
    results = {}
    for name in f.models:
        print(f'profiling {name} ({f.warmup_steps} steps, then {f.steps} under the log) ...', flush=True)
        figures = profile(name)
        if figures:
            results[name] = figures
    peak = benchmark_step.matmul_peak_flops(f.peak_size, f.peak_repeats) if f.peak_repeats else 0.0
    if peak:
        print(f'peak: a {f.peak_size} x {f.peak_size} float32 matrix product at {peak / 1e9:.1f} GFLOP/s')
    for name, figures in results.items():
        report(name, figures, peak, f.top)
    print(json.dumps({'environment': environment, 'inter_op_threads': f.inter_op_threads,
                      'matmul_peak_gflops': round(peak / 1e9, 1) if peak else None,
                      'models': {name: {'step_ms': figures['step_ms'], 'kinds': {
                          kind: {'ms': round(values['ms'], 2), 'gflop': round(values['gflop'], 3)}
                          for kind, values in figures['kinds'].items()}} for name, figures in results.items()}}))


if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    define_flags()
    app.run(main)
