"""Which tf.distribute strategy runs the job: TPU pod, GPUs, several workers, or N logical CPU devices.

The TPU calls live in ``_tpu_strategy`` alone. Logical CPU devices must be declared before TensorFlow
initializes its devices, so ``use_logical_cpus`` is called first thing in a process (the commands, the tests).
"""

import functools
import json
import os

import tensorflow as tf

from imagenet_tpu.distribute import cluster
from imagenet_tpu.distribute import collectives
from imagenet_tpu.distribute import mesh as tpu_mesh
from imagenet_tpu.errors import ConfigError

is_tpu_strategy = collectives.is_tpu_strategy


def use_logical_cpus(count: int) -> None:
    """Splits the host CPU into ``count`` logical devices; a no-op if it is already split that way.

    Raises ConfigError if TensorFlow has already initialized its devices with a different split.
    """
    cpu = tf.config.list_physical_devices('CPU')[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as error:
        raise ConfigError(f'cannot make {count} logical CPU devices after TensorFlow has started: {error}')


_COLLECTIVE_KEY_SPACING = 100_000


def mirrored_strategy(devices=None, cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over ``devices`` (default: all local GPUs, else the CPU) whose collective keys differ
    from those of every earlier strategy in this process.

    TF 2.20 starts every MirroredStrategy's collective group and instance keys at the same numbers
    (the class attribute _collective_key_base is never advanced), so a second strategy in one process, in a
    notebook or a test suite, reuses the keys of the first and its all-reduces fail with "Shape mismatch in the
    collective instance" (seen with TF 2.20). TensorFlow's own tests advance the base by hand; so do we.
    """
    tf.distribute.MirroredStrategy._collective_key_base += _COLLECTIVE_KEY_SPACING
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)


def cpu_strategy(count: int) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over ``count`` logical CPU devices, reducing on one device.

    TF 2.20 gives MirroredStrategy on CPU devices ring collectives by default. Between logical devices that share
    one memory that is the slow choice: ReductionToOneDevice (copy to one device, add, copy back) is several
    times faster for batch-norm statistics and gradients alike, and keeps the ~100 small all-reduces of
    replica-group batch norm per ResNet-50 step from costing a sixth of the step (docs/benchmarks.md,
    tools/benchmarks/benchmark_distributed.py).
    """
    split = tf.config.get_logical_device_configuration(tf.config.list_physical_devices('CPU')[0])
    if split is None or len(split) < count:    # (a process split into more devices uses the first ``count``)
        use_logical_cpus(count)                # ConfigError when TensorFlow has started with fewer
    devices = [device.name for device in tf.config.list_logical_devices('CPU')]
    return mirrored_strategy(devices[:count], tf.distribute.ReductionToOneDevice())


_TPU_PLACEMENT = {}     # id(strategy) -> tpu_mesh.Placement of its replicas (None: a degraded slice)


def tpu_unreachable_message(tpu: str, error: BaseException) -> str:
    """One line for a TPU that cannot be reached, naming the likely fix for the kind of failure."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if 'TPUs not found' in detail or 'ConfigureDistributedTPU' in detail or 'No OpKernel' in detail:
        cause = ('this TensorFlow has no TPU kernels or sees no TPU: on a TPU VM install tensorflow-tpu '
                 '(BUILD.md) and use --tpu=local')
    elif tpu != 'local':
        cause = f'no TPU named {tpu!r} answers: check the name and zone, or use --tpu=local on a TPU VM'
    else:
        cause = 'this machine is not a TPU VM, or its TPU is in use by another process'
    detail = detail if len(detail) <= 160 else detail[:157] + '...'
    return f"cannot start the TPU system for --tpu={tpu} ({cause}; or run on CPUs with --strategy=cpu): {detail}"


def tpu_device_assignment(topology: tf.tpu.experimental.Topology):
    """(DeviceAssignment, Placement) of a slice: one replica per TPU device, in TPUStrategy's own order (host by
    host, tpu_mesh's docstring says why), made explicit so that the placement the groups are computed from is
    the one that runs. (None, None) for a slice whose chips do not fill a box (a degraded slice): TensorFlow's
    default order then, and no mesh."""
    try:
        placement = tpu_mesh.Placement.from_topology(topology.device_coordinates)
    except ValueError:
        return None, None
    assignment = tf.tpu.experimental.DeviceAssignment(
        topology, placement.core_assignment(topology.device_coordinates))
    return assignment, placement


def check_tpu_worker(environ=os.environ) -> None:
    """ConfigError on a TPU VM other than worker 0 of its slice (TPU_WORKER_ID, which Cloud TPU sets on each VM):
    TensorFlow drives a whole slice from one process, which connects to every host's TPU server; a second
    process on another VM would initialize the slice again under the first one."""
    worker = environ.get('TPU_WORKER_ID', '').strip()
    if worker and worker != '0':
        raise ConfigError(f'this VM is worker {worker} of this TPU slice: run the command once, on worker 0 (one '
                          'process drives every host of the slice)')


def _tpu_strategy(tpu: str, hosts: int = 0) -> tf.distribute.Strategy:
    check_tpu_worker()
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (tf.errors.OpError, OSError, ValueError, RuntimeError) as error:
        raise ConfigError(tpu_unreachable_message(tpu, error)) from None
    check_tpu_hosts(topology.num_tasks, hosts, tpu)
    assignment, placement = tpu_device_assignment(topology)
    strategy = tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)
    _TPU_PLACEMENT[id(strategy)] = placement
    return strategy


def check_tpu_hosts(seen: int, expected: int, tpu: str) -> None:
    """ConfigError when the TPU system shows fewer hosts than the recipe's slice has (``expected``, 0: any)."""
    if expected and seen < expected:
        raise ConfigError(f'--tpu={tpu} shows {seen} TPU host{"s" if seen != 1 else ""} but --topology implies '
                          f'{expected}: name the pod slice with --tpu=NAME (local sees one host only)')


def tpu_placement(strategy: tf.distribute.Strategy):
    """The tpu_mesh.Placement of a TPU strategy made here (None for other strategies)."""
    return _TPU_PLACEMENT.get(id(strategy))


def replica_order(strategy: tf.distribute.Strategy):
    """The replica at each mesh index (collectives.py), or None where replica r sits at mesh index r."""
    placement = tpu_placement(strategy)
    return placement.replica_order if placement is not None else None


def check_mesh(strategy: tf.distribute.Strategy, mesh_shape=None, cores_per_chip: int = 2,
               uses_replica_order: bool = False) -> None:
    """On a TPU slice, --mesh_shape must be its torus (X, Y * Z chips) and --cores_per_chip its devices per chip:
    tiles of another mesh are not neighbouring chips. ``uses_replica_order``: the run's batch-norm groups or 2-D
    all-reduce follow the replicas' places on the torus, which only a TPUStrategy made by make_strategy records
    (its explicit DeviceAssignment); one made elsewhere is refused rather than grouped as if replica r sat at mesh
    index r."""
    if uses_replica_order and is_tpu_strategy(strategy) and id(strategy) not in _TPU_PLACEMENT:
        raise ConfigError('this TPUStrategy was not made by imagenet_tpu (builders.build_strategy): its replicas\' '
                          'places on the torus are unknown, so batch-norm groups and the 2-D all-reduce cannot '
                          'follow them; pass no strategy, or one from builders.build_strategy(config)')
    placement = tpu_placement(strategy)
    if placement is None:
        return
    if mesh_shape and tuple(mesh_shape) != placement.chip_mesh:
        x, y, z = placement.chips
        raise ConfigError(f'--mesh_shape={mesh_shape[0]}x{mesh_shape[1]} but this slice is {x}x{y}x{z} chips: use '
                          f'--mesh_shape={x}x{y * z}')
    if mesh_shape and cores_per_chip != placement.replicas_per_chip:
        raise ConfigError(f'--cores_per_chip={cores_per_chip} but this slice has {placement.replicas_per_chip} '
                          f'TPU device(s) per chip: use --cores_per_chip={placement.replicas_per_chip}')


def replica_mesh_shape(strategy: tf.distribute.Strategy, mesh_shape=None, cores_per_chip: int = 2):
    """(X, Y) replicas of the mesh that all_reduce_2d uses.

    From ``mesh_shape`` (X, Y chips) when given: (X * cores_per_chip, Y), a row being one row of chips with each
    chip's cores side by side. Else, on TPU, the slice's torus (tpu_mesh.Placement.replica_mesh: X * devices per
    chip, Y * Z); else the most square factorization of the replica count.
    """
    num_replicas = strategy.num_replicas_in_sync
    check_mesh(strategy, mesh_shape, cores_per_chip)
    if mesh_shape:
        shape = (mesh_shape[0] * cores_per_chip, mesh_shape[1])
    elif tpu_placement(strategy) is not None:
        shape = tpu_placement(strategy).replica_mesh
    else:
        shape = collectives.default_mesh_shape(num_replicas)
    if shape[0] * shape[1] != num_replicas:
        raise ConfigError(f'mesh of {shape[0]}x{shape[1]} replicas does not match the {num_replicas} replicas '
                          f'(--mesh_shape is in chips, times --cores_per_chip={cores_per_chip} along x)')
    return shape


def multi_worker_strategy(cpu_devices_per_worker: int = 1) -> tf.distribute.MultiWorkerMirroredStrategy:
    """MultiWorkerMirroredStrategy from TF_CONFIG. On workers without GPUs it has one replica per worker (the
    CPU); with ``cpu_devices_per_worker`` > 1, that many logical CPU devices of each worker are its replicas,
    so that workers on one machine stand for a pod of several accelerators per host (its cross-host collectives,
    input pipelines and checkpoints as on a pod). TensorFlow 2.20 has no setting for it: its device list is
    replaced while the strategy is made."""
    if cpu_devices_per_worker == 1 or tf.config.list_physical_devices('GPU'):
        return tf.distribute.MultiWorkerMirroredStrategy()
    use_logical_cpus(cpu_devices_per_worker)
    # pylint: disable-next=import-outside-toplevel
    from tensorflow.python.distribute import collective_all_reduce_strategy as collective
    extended = collective.CollectiveAllReduceExtended
    original = extended._initialize_local_devices  # pylint: disable=protected-access

    def logical_cpus(self, cluster_resolver, worker_device):
        del self, cluster_resolver
        return tuple(f'{worker_device}/device:CPU:{i}' for i in range(cpu_devices_per_worker)), 'CPU'

    extended._initialize_local_devices = logical_cpus  # pylint: disable=protected-access
    try:
        return tf.distribute.MultiWorkerMirroredStrategy()
    finally:
        extended._initialize_local_devices = original  # pylint: disable=protected-access


def make_strategy(kind: str, *, num_cpu_devices: int = 8, tpu: str = '', cpu_devices_per_worker: int = 1,
                  tpu_hosts: int = 0, cluster_source: str = 'auto', cluster_port: int = 8888) -> tf.distribute.Strategy:
    """The strategy named by ``kind``.

    'cpu': MirroredStrategy over ``num_cpu_devices`` logical CPU devices (development and tests);
    'mirrored': MirroredStrategy over the local GPUs; 'multi_worker': MultiWorkerMirroredStrategy from TF_CONFIG
    or, by ``cluster_source``, the tasks of a Slurm job step (cluster.cluster_config, which then sets TF_CONFIG;
    multi_worker_strategy; a TF_CONFIG that cannot describe this process's cluster is a ConfigError naming
    what is wrong, cluster.check_tf_config); 'tpu': TPUStrategy for ``tpu`` (a name or 'local'), replicas
    placed as tpu_mesh says, refused when it shows fewer hosts than ``tpu_hosts``; 'default': no distribution.
    """
    if kind == 'cpu':
        return cpu_strategy(num_cpu_devices)
    if kind == 'mirrored':
        if not tf.config.list_physical_devices('GPU'):
            raise ConfigError("strategy 'mirrored' needs GPUs and none is visible; use --strategy=cpu")
        return mirrored_strategy()
    if kind == 'multi_worker':
        text = cluster.cluster_config(cluster_source, cluster_port)
        if text and text != os.environ.get('TF_CONFIG'):     # from Slurm
            os.environ['TF_CONFIG'] = text     # what TensorFlow's strategy reads
            value = json.loads(text)
            print(f'Slurm task {value["task"]["index"]} of {len(value["cluster"]["worker"])}: workers '
                  f'{", ".join(value["cluster"]["worker"])}', flush=True)
        cluster.check_tf_config(os.environ.get('TF_CONFIG'))
        cluster.wait_for_peers(os.environ.get('TF_CONFIG'), functools.partial(print, flush=True))
        try:
            return multi_worker_strategy(cpu_devices_per_worker)
        except ConfigError:
            raise
        except ValueError as error:     # a cluster TensorFlow refuses beyond check_tf_config's checks
            raise ConfigError(f'TF_CONFIG: {str(error).strip().splitlines()[0]}') from None
    if kind == 'tpu':
        if not tpu:
            raise ConfigError("strategy 'tpu' needs --tpu=NAME (or 'local' on a TPU VM)")
        return _tpu_strategy(tpu, tpu_hosts)
    if kind == 'default':
        return tf.distribute.get_strategy()
    raise ConfigError(f'unknown strategy {kind!r}')


def num_input_pipelines(strategy: tf.distribute.Strategy) -> int:
    """Input pipelines distribute_datasets_from_function makes: one per host (TPU) or worker (multi-worker)."""
    extended = strategy.extended
    if is_tpu_strategy(strategy):
        return extended.num_hosts
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return extended._num_workers  # pylint: disable=protected-access  (no public count in TF 2.20)
    return 1


def replica_devices(strategy: tf.distribute.Strategy) -> tuple:
    """This process's replica devices (TensorFlow names); () for the default strategy (the default device)."""
    try:
        return tuple(strategy.extended.worker_devices)
    except (RuntimeError, NotImplementedError, ValueError):
        return ()


def _device_type(device: str) -> str:
    return (tf.DeviceSpec.from_string(device).device_type or '').upper()


def xla_by_default(strategy: tf.distribute.Strategy) -> bool:
    """Whether the train step is XLA-compiled by default: where every replica of this process is a GPU (without a
    strategy: where a GPU is visible). TPUs compile everything anyway, and on CPUs XLA's gain is small."""
    devices = replica_devices(strategy)
    if not devices:
        return bool(tf.config.list_physical_devices('GPU'))
    return all(_device_type(device) == 'GPU' for device in devices)


def check_jit_compile(strategy: tf.distribute.Strategy) -> None:
    """ConfigError for --jit_compile under a strategy of several local CPU replicas: TF 2.20 wraps one XLA program
    around every replica's variables there, and the first step fails ("Trying to access resource
    .../replica_1 ... located in device CPU:1 from device CPU:0")."""
    devices = replica_devices(strategy)
    if is_tpu_strategy(strategy) or len(devices) < 2:
        return
    if any(_device_type(device) != 'GPU' for device in devices):
        raise ConfigError(f'--jit_compile does not work with {len(devices)} CPU replicas in one process (XLA '
                          'mixes the replicas\' devices); use --nojit_compile, or --num_cpu_devices=1')
