"""A run planned before it starts: the counts training derives (with training's own code), memory per replica
against the chip's HBM, one step's parts, images/s, the input each host must decode, and the time to train.

    plan(config)  ->  a dict (imagenet-tpu-plan prints it, or with --json prints it as JSON)

config.topology names the hardware (config.parse_topology): a TPU slice, GPUs, or cpu (this machine, its peak
measured). Every count that training also derives comes from the function training uses: the replica checks and
batch-norm groups (builders.check_replicas, Config.bn_group_size_for), steps and evaluations (Config.train_steps,
loop.planned_evaluations), evaluation steps per input pipeline (Config.eval_steps_for), steps per host call
(builders.default_steps_per_execution), the network (builders.build_network, counted by costs.count).
"""

import dataclasses
import math
import os
import time
from typing import Optional

import tensorflow as tf

from imagenet_tpu import builders, hardware
from imagenet_tpu.config import Config, ConfigError
from imagenet_tpu.distribute import collectives
from imagenet_tpu.hardware import parse_topology
from imagenet_tpu.plan import costs as costs_lib
from imagenet_tpu.plan import model
from imagenet_tpu.training import loop

SLOT_BYTES = {'sgd': 4, 'lars': 4, 'rmsprop_warmup': 8}     # float32 optimizer slots per parameter
TORUS_DIMENSIONS = {'v4': 3, 'v5p': 3}                      # the others are 2-D tori


def measured_cpu_peak_tflops(size: int = 1024, rounds: int = 5) -> float:
    """This machine's float32 matrix-product rate with TensorFlow's threads (the best of ``rounds``), TFLOP/s."""
    a = tf.random.normal([size, size])
    product = tf.function(lambda x: tf.matmul(x, x))
    product(a).numpy()
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        product(a).numpy()
        best = min(best, time.perf_counter() - started)
    return 2 * size ** 3 / best / 1e12


def network_costs(config: Config) -> costs_lib.NetworkCosts:
    """The costs of the network training builds for ``config`` (one replica's layers: the same operations)."""
    return costs_lib.count(builders.build_network(dataclasses.replace(config, bn_group_size=1, bn_span=None), 1))


def plan(config: Config, to_accuracy: Optional[float] = None, cpu_peak_tflops: Optional[float] = None,
         counted: Optional[costs_lib.NetworkCosts] = None) -> dict:
    """The plan of ``config`` on config.topology; ``to_accuracy`` (only MLPerf's 0.759 has reference points) adds
    the epochs and minutes to reach it at this global batch; ``counted``: the network's costs, if already counted
    (network_costs). ConfigError for what cannot run there."""
    if not config.topology:
        raise ConfigError('--topology is not set: name the hardware, e.g. v3-8192, v4-128, 8xH100 or cpu')
    if to_accuracy is not None and abs(to_accuracy - model.REFERENCE_ACCURACY) > 1e-9:
        raise ConfigError(f'--to_accuracy: reference points exist for {model.REFERENCE_ACCURACY} top-1 only '
                          f'(MLPerf), got {to_accuracy}')
    topology = parse_topology(config.topology)
    replicas, hosts, chips = topology.replicas, topology.hosts, topology.chips
    if topology.kind == 'cpu':     # logical devices of this machine: they share its peak and its cores
        peak = cpu_peak_tflops if cpu_peak_tflops is not None else measured_cpu_peak_tflops()
        chip = hardware.chip('cpu', peak / chips, cpu_cores=max(1, (os.cpu_count() or 1) // hosts))
    else:
        chip = hardware.chip(topology.chip)
    builders.check_replicas(config, replicas)
    per_replica = config.global_batch_size // replicas
    group = config.bn_group_size_for(replicas) if config.norm != 'none' else 1
    replicas_per_chip = replicas // chips
    tiles = None
    if config.mesh_shape and group > 1:
        tiles = collectives.tile_shape(group, replicas_per_chip, config.mesh_shape)

    counted = counted or network_costs(config)
    element_bytes = 2 if config.precision.startswith('mixed') else 4
    gradient_bytes = counted.parameters * (2 if config.allreduce_dtype == 'bfloat16' else 4)
    mesh = None
    if topology.kind == 'tpu':
        mesh = (tuple(config.mesh_shape) if config.mesh_shape
                else model.torus_shape(chips, TORUS_DIMENSIONS.get(topology.chip, 2)))
    per_call = builders.default_steps_per_execution(config, topology.kind == 'tpu')
    host_cores = chip.host_cores
    parts = model.step_parts(topology.kind, chip, chips, hosts, config.global_batch_size, counted.training_flops,
                             counted.activations, counted.parameters, element_bytes, gradient_bytes, mesh,
                             host_cores=host_cores, steps_per_execution=per_call)
    ring = model.allreduce_seconds(topology.kind, chip, chips, hosts, gradient_bytes, None)
    images_per_second = config.global_batch_size / parts.total

    # Memory per replica: float32 variables, their gradients and optimizer slots, a 16-bit copy under mixed
    # precision, and the activations kept for the backward pass.
    fixed = (counted.variables * 4 + counted.parameters * (4 + SLOT_BYTES[config.optimizer])
             + (counted.parameters * 2 if element_bytes == 2 else 0))
    per_image = counted.activations * element_bytes
    memory = fixed + per_replica * per_image
    hbm = chip.hbm_gib * 2 ** 30 / replicas_per_chip
    largest = max(0, int((hbm - fixed) // per_image))

    steps = config.train_steps
    epochs = steps * config.global_batch_size / config.num_train_images
    evaluations = loop.planned_evaluations(config)
    eval_steps = config.eval_steps_for(hosts)
    per_evaluation = model.evaluation_seconds(chip, chips, config.num_eval_images, eval_steps,
                                              counted.training_flops, counted.activations, element_bytes,
                                              steps_per_execution=per_call)
    result = {
        'topology': config.topology, 'chip': chip.name, 'chips': chips, 'replicas': replicas, 'hosts': hosts,
        'input_pipelines': hosts, 'per_replica_batch': per_replica, 'global_batch': config.global_batch_size,
        'bn_group_replicas': group, 'bn_group_images': group * per_replica,
        'bn_group_tile_chips': list(tiles) if tiles else None, 'torus_chips': list(mesh) if mesh else None,
        'steps': steps, 'epochs': epochs, 'evaluations': evaluations, 'eval_steps': eval_steps,
        'steps_per_execution': per_call,
        'forward_gmacs_per_image': counted.forward_macs / 1e9, 'parameters': counted.parameters,
        'memory_gib_per_replica': memory / 2 ** 30, 'hbm_gib': hbm / 2 ** 30, 'fits': memory <= hbm,
        'largest_per_replica_batch': largest,
        'step_seconds': parts.total, 'step_parts_ms': {name: value * 1e3 for name, value in parts._asdict().items()},
        'allreduce_ring_ms': ring * 1e3, 'allreduce_torus_ms': parts.allreduce * 1e3 if mesh else None,
        'bound': parts.bound,
        'images_per_second': images_per_second, 'images_per_second_per_chip': images_per_second / chips,
        'input_images_per_second_per_host': images_per_second / hosts,
        'decode_cores_per_host': images_per_second / hosts / model.DECODE_IMAGES_PER_SECOND_PER_CORE,
        'host_cores': host_cores,
        'evaluation_seconds': per_evaluation,
        'minutes_to_train': model.minutes_to_train(epochs, config.num_train_images, images_per_second,
                                                   evaluations, per_evaluation),
    }
    if to_accuracy is not None:
        reference_epochs, inside = model.epochs_to_accuracy(config.global_batch_size)
        reference_evaluations = int(reference_epochs // config.eval_every_epochs) + 1
        result.update({
            'to_accuracy': to_accuracy, 'epochs_to_accuracy': reference_epochs,
            'within_reference_points': inside,
            'minutes_to_accuracy': model.minutes_to_train(reference_epochs, config.num_train_images,
                                                          images_per_second, reference_evaluations,
                                                          per_evaluation)})
    return result
