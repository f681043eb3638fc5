"""The scaling picture of a recipe: images/s and time to train against the number of chips, at the recipe's
per-replica batch, with the published MLPerf runs of the same chip drawn on it."""

import dataclasses
import io
from typing import List, Optional

from imagenet_tpu import files
from imagenet_tpu.config import Config
from imagenet_tpu.hardware import parse_topology
from imagenet_tpu.plan import model, planner, published

CHIP_COUNTS = tuple(2 ** power for power in range(2, 13))     # 4 ... 4,096 chips


def topology_name(kind: str, chip: str, chips: int) -> str:
    """A --topology of ``chips`` chips of ``chip``: a TPU slice (named by cores on v2-v5p, chips on v5e) or GPUs
    in hosts of 8."""
    if kind == 'tpu':
        return f'{chip}-{chips * 2 if chip in ("v2", "v3", "v4", "v5p") else chips}'
    return f'{chips}x{chip}' if chips <= 8 else f'{chips // 8}x8x{chip}'


def points(config: Config, to_accuracy: Optional[float] = None) -> List[dict]:
    """Plans of the recipe on CHIP_COUNTS chips of config.topology's chip, at its per-replica batch; epochs from
    the reference points with ``to_accuracy``, else the recipe's."""
    topology = parse_topology(config.topology)
    per_replica = config.global_batch_size // topology.replicas
    per_chip_replicas = topology.replicas // topology.chips
    counted = planner.network_costs(config)
    epochs = config.train_steps * config.global_batch_size / config.num_train_images
    results = []
    for chips in CHIP_COUNTS:
        batch = per_replica * per_chip_replicas * chips
        run_epochs = model.epochs_to_accuracy(batch)[0] if to_accuracy else epochs
        scaled = dataclasses.replace(config, topology=topology_name(topology.kind, topology.chip, chips),
                                     global_batch_size=batch, eval_batch_size=batch, total_steps=None,
                                     train_epochs=run_epochs, bn_group_size=1, bn_span=None, mesh_shape=None,
                                     strategy='default')
        results.append(planner.plan(scaled, counted=counted))
    return results


def draw(config: Config, path: str, to_accuracy: Optional[float] = None) -> None:
    """Writes the picture to ``path`` (PNG)."""
    import matplotlib   # pylint: disable=import-outside-toplevel  (only for --scaling)
    matplotlib.use('Agg')
    from matplotlib import pyplot   # pylint: disable=import-outside-toplevel
    topology = parse_topology(config.topology)
    planned = points(config, to_accuracy)
    runs = [run for run in published.RUNS if run.chip == topology.chip]
    figure, (rate, minutes) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    chips = [p['chips'] for p in planned]
    rate.plot(chips, [p['images_per_second'] for p in planned], 'o-', label='planned')
    minutes.plot(chips, [p['minutes_to_train'] for p in planned], 'o-', label='planned')
    if runs:
        rate.plot([r.accelerators for r in runs], [r.epochs * 1281167 / (r.minutes * 60) for r in runs], 's',
                  label='published (MLPerf, implied by epochs and minutes)')
        minutes.plot([r.accelerators for r in runs], [r.minutes for r in runs], 's', label='published (MLPerf)')
    for axis, label in ((rate, 'images/s'), (minutes, 'minutes to train')):
        axis.set_xscale('log', base=2)
        axis.set_yscale('log')
        axis.set_xlabel(f'{planned[0]["chip"]} chips')
        axis.set_ylabel(label)
        axis.grid(alpha=0.3, which='both')
        axis.legend(fontsize=8)
    per_replica = config.global_batch_size // topology.replicas
    figure.suptitle(f'ResNet-{config.depth}, {per_replica} images per replica, '
                    + ('epochs to 75.9% from MLPerf reference points' if to_accuracy else "the recipe's epochs"))
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format='png', dpi=100)
    pyplot.close(figure)
    files.write_atomically(path, image.getvalue())     # a missing or read-only folder: one OutputError line
