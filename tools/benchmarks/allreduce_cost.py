"""Alpha-beta cost model of summing ResNet-50's gradients: flat ring vs 2-D torus all-reduce, 8 to 4,096 chips.

For N chips, a message of S bytes sent in k buckets, per-hop latency alpha (s) and all-reduce bandwidth B
(bytes/s per chip):

    ring:              k * 2 (N - 1) * alpha      +  2 (N - 1) / N * S / B
    2-D torus X x Y:   k * 2 (X + Y - 2) * alpha  +  2 (N - 1) / N * S / B

(reduce-scatter along rows: X - 1 hops, all-reduce along columns: 2 (Y - 1), all-gather along rows: X - 1; the
bandwidth terms add up to the ring's). Defaults: TPU v3, about 332 GB/s of all-reduce bandwidth per chip (the
pod's 340 TB/s over 1,024 chips), ResNet-50's 25,557,032 gradients, 32 MiB buckets; the per-hop latency is an
assumption to set (--hop_latency_us, default 1 us). Prints a table and writes a PNG of time vs chip count.

    python tools/benchmarks/allreduce_cost.py --output allreduce_cost.png
"""

import math

from absl import app, flags

from imagenet_tpu.distribute import collectives
from imagenet_tpu.plan.model import ring_seconds, torus_seconds   # the planner's cost model, one source

RESNET50_PARAMETERS = 25_557_032
TPU_V3_BANDWIDTH = 340e12 / 1024          # bytes/s of all-reduce bandwidth per chip
CHIP_COUNTS = tuple(2 ** p for p in range(3, 13))   # 8 ... 4096


def table(parameters=RESNET50_PARAMETERS, hop_latency=1e-6, bandwidth=TPU_V3_BANDWIDTH,
          bucket_bytes=32 * 2 ** 20, chip_counts=CHIP_COUNTS):
    """Rows of dicts: chips, mesh, dtype, buckets, ring_ms, torus_ms, speedup."""
    rows = []
    for dtype, size in (('float32', 4), ('bfloat16', 2)):
        message = parameters * size
        buckets = math.ceil(message / bucket_bytes)
        for chips in chip_counts:
            mesh = collectives.default_mesh_shape(chips)  # the mesh all_reduce_2d uses by default
            ring = ring_seconds(chips, message, buckets, hop_latency, bandwidth)
            torus = torus_seconds(mesh, message, buckets, hop_latency, bandwidth)
            rows.append(dict(chips=chips, mesh=f'{mesh[0]}x{mesh[1]}', dtype=dtype, buckets=buckets,
                             ring_ms=ring * 1e3, torus_ms=torus * 1e3, speedup=ring / torus))
    return rows


def plot(rows, output):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(7, 4))
    for dtype, style in (('float32', '-'), ('bfloat16', '--')):
        chosen = [r for r in rows if r['dtype'] == dtype]
        chips = [r['chips'] for r in chosen]
        axis.plot(chips, [r['ring_ms'] for r in chosen], 'o' + style, color='tab:red', label=f'ring, {dtype}')
        axis.plot(chips, [r['torus_ms'] for r in chosen], 's' + style, color='tab:blue', label=f'2-D torus, {dtype}')
    axis.set_xscale('log', base=2)
    axis.set_yscale('log')
    axis.set_xlabel('TPU v3 chips')
    axis.set_ylabel('all-reduce time per step (ms)')
    axis.set_title('Summing ResNet-50 gradients: alpha-beta model')
    axis.grid(alpha=0.3, which='both')
    axis.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=100)


def main(argv):
    del argv
    f = flags.FLAGS
    rows = table(hop_latency=f.hop_latency_us * 1e-6, bandwidth=f.bandwidth_gbps * 1e9,
                 bucket_bytes=int(f.bucket_mb * 2 ** 20))
    print(f'{"chips":>6} {"mesh":>6} {"dtype":>9} {"buckets":>7} {"ring ms":>9} {"2-D ms":>9} {"speedup":>8}')
    for r in rows:
        print(f'{r["chips"]:>6} {r["mesh"]:>6} {r["dtype"]:>9} {r["buckets"]:>7} {r["ring_ms"]:>9.3f} '
              f'{r["torus_ms"]:>9.3f} {r["speedup"]:>7.2f}x')
    plot(rows, f.output)
    print(f'wrote {f.output}')


if __name__ == '__main__':
    flags.DEFINE_float('hop_latency_us', 1.0, 'Latency per hop, microseconds (an assumption; set your own).')
    flags.DEFINE_float('bandwidth_gbps', TPU_V3_BANDWIDTH / 1e9, 'All-reduce bandwidth per chip, GB/s.')
    flags.DEFINE_float('bucket_mb', 32.0, 'Gradient bucket size, MiB.')
    flags.DEFINE_string('output', 'allreduce_cost.png', 'PNG to write.')
    app.run(main)
