"""Strategies: a TPU or GPU strategy where there is none is a one-line ConfigError naming the fix (the real TPU
attempt runs in a process of its own: main_test)."""

import os
import types
from unittest import mock

import numpy as np
import tensorflow as tf
import tf_keras as keras

import helpers
from imagenet_tpu.distribute import cluster
from imagenet_tpu.distribute import strategy
from imagenet_tpu import builders
from imagenet_tpu.config import Config, ConfigError

helpers.use_eight_cpus()


def fake_strategy(*devices):
    return types.SimpleNamespace(extended=types.SimpleNamespace(worker_devices=devices))


def fit_one_step(distribution, jit_compile: bool) -> None:
    with distribution.scope():
        model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
        model.compile(optimizer='sgd', loss='mse', jit_compile=jit_compile)
    model.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), batch_size=8, epochs=1, verbose=0)


class StrategyTest(tf.test.TestCase):

    def test_tpu_messages_name_the_fix_for_each_kind_of_failure(self):
        no_kernel = tf.errors.NotFoundError(None, None, "TPUs not found in the cluster. Failed in initialization: "
                                                        "No OpKernel was registered to support Op "
                                                        "'ConfigureDistributedTPU'\nRegistered devices: [CPU]")
        message = strategy.tpu_unreachable_message('local', no_kernel)
        self.assertIn('install tensorflow-tpu', message)
        self.assertIn('--strategy=cpu', message)
        self.assertNotIn('\n', message)
        message = strategy.tpu_unreachable_message('my-pod', OSError('Name or service not known'))
        self.assertIn("no TPU named 'my-pod' answers", message)
        self.assertIn('Name or service not known', message)
        message = strategy.tpu_unreachable_message('local', RuntimeError('x' * 500))
        self.assertLess(len(message), 400)

    def test_mirrored_strategy_without_gpus(self):
        if tf.config.list_physical_devices('GPU'):
            self.skipTest('this machine has GPUs')
        with self.assertRaisesRegex(ConfigError, "needs GPUs and none is visible; use --strategy=cpu"):
            strategy.make_strategy('mirrored')

    def test_xla_by_default_only_where_every_replica_is_a_gpu(self):
        real = tf.config.list_physical_devices
        with mock.patch.object(tf.config, 'list_physical_devices',
                               lambda kind=None: ['GPU:0'] if kind == 'GPU' else real(kind)):
            # A machine with a GPU running the demo's strategy: CPU replicas, so no XLA (it fails there).
            self.assertFalse(builders.use_jit(Config(), helpers.mirrored(2)))
            self.assertTrue(builders.use_jit(Config(), tf.distribute.get_strategy()))
        gpus = [f'/job:localhost/replica:0/task:0/device:GPU:{i}' for i in range(2)]
        self.assertTrue(strategy.xla_by_default(fake_strategy(*gpus)))
        self.assertFalse(strategy.xla_by_default(fake_strategy(gpus[0], '/job:localhost/replica:0/task:0/device:CPU:0')))
        self.assertFalse(builders.use_jit(Config(), helpers.mirrored(2)))

    def test_jit_compile_under_several_cpu_replicas_is_refused_as_tensorflow_fails_there(self):
        # What --jit_compile meets under MirroredStrategy over logical CPUs: the first step fails.
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'Trying to access resource'):
            fit_one_step(helpers.mirrored(2), jit_compile=True)
        with self.assertRaisesRegex(ConfigError, '--jit_compile does not work with 2 CPU replicas in one process'):
            builders.use_jit(Config(jit_compile=True), helpers.mirrored(2))
        # One replica, and GPUs, keep it.
        fit_one_step(tf.distribute.get_strategy(), jit_compile=True)
        self.assertTrue(builders.use_jit(Config(jit_compile=True), tf.distribute.get_strategy()))
        self.assertTrue(builders.use_jit(Config(jit_compile=True), helpers.mirrored(1)))
        strategy.check_jit_compile(fake_strategy('/device:GPU:0', '/device:GPU:1'))

    def test_both_tpu_strategy_classes_are_tpu_strategies(self):
        for cls in (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy):
            self.assertTrue(strategy.is_tpu_strategy(object.__new__(cls)))
        self.assertFalse(strategy.is_tpu_strategy(helpers.mirrored(2)))
        self.assertFalse(issubclass(tf.distribute.experimental.TPUStrategy, tf.distribute.TPUStrategy))

    def test_a_tpu_strategy_made_elsewhere_is_refused_where_groups_follow_the_torus(self):
        foreign = object.__new__(tf.distribute.TPUStrategy)     # a caller's own TPUStrategy: no known placement
        with self.assertRaisesRegex(ConfigError, 'not made by imagenet_tpu'):
            strategy.check_mesh(foreign, None, 2, uses_replica_order=True)
        strategy.check_mesh(foreign, None, 2, uses_replica_order=False)   # per-replica BN, the strategy's all-reduce
        strategy.check_mesh(helpers.mirrored(2), None, 2, uses_replica_order=True)

    def test_the_command_runs_on_worker_0_of_a_slice_only(self):
        self.assertIsNone(strategy.check_tpu_worker({}))
        self.assertIsNone(strategy.check_tpu_worker({'TPU_WORKER_ID': '0'}))
        with self.assertRaisesRegex(ConfigError, 'worker 3 of this TPU slice.*once, on worker 0'):
            strategy.check_tpu_worker({'TPU_WORKER_ID': '3'})

    def test_tpu_strategy_needs_a_name(self):
        with self.assertRaisesRegex(ConfigError, "needs --tpu=NAME"):
            strategy.make_strategy('tpu')

    def test_a_tf_config_that_cannot_work_is_one_line_naming_what_is_wrong(self):
        workers = '{"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}'
        cases = (
            ('{"cluster": ',
             r'^TF_CONFIG is not JSON \(Expecting value: line 1 column 13 \(char 12\)\); expected e\.g\. \{"cluster'),
            ('["10.0.0.1:2222"]', r'^TF_CONFIG is a JSON list, not an object'),
            ('{"task": {"type": "worker", "index": 0}}', r'^TF_CONFIG has no "cluster"'),
            (f'{{"cluster": {workers}}}', r'^TF_CONFIG has no "task"'),
            (f'{{"cluster": {workers}, "task": {{"type": "worker", "index": 2}}}}',
             r'^TF_CONFIG task index 2 is outside the cluster: worker has 2 tasks \(indices 0, 1\)$'),
            (f'{{"cluster": {workers}, "task": {{"type": "worker", "index": -1}}}}',
             r'^TF_CONFIG task index -1 is not a count'),
            (f'{{"cluster": {workers}, "task": {{"type": "ps", "index": 0}}}}',
             r'^TF_CONFIG task type "ps" is not a job of its cluster \(worker\)$'),
            (f'{{"cluster": {workers}, "task": {{"index": 0}}}}', r'^TF_CONFIG "task" must be \{"type": JOB'),
            ('{"cluster": {"worker": ["10.0.0.1"]}, "task": {"type": "worker", "index": 0}}',
             r'^TF_CONFIG job .worker. has "10.0.0.1", not a host:port address$'),
            ('{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}',
             r'^TF_CONFIG job .worker. must be a list of host:port addresses'),
            ('{"cluster": {"trainer": ["10.0.0.1:2222"]}, "task": {"type": "trainer", "index": 0}}',
             r'^TF_CONFIG "cluster" has a job .trainer.; jobs are chief, worker, evaluator, ps$'),
        )
        for tf_config, expected in cases:
            with self.subTest(tf_config=tf_config):
                with self.assertRaisesRegex(ConfigError, expected) as raised:
                    cluster.check_tf_config(tf_config)
                self.assertNotIn('\n', str(raised.exception))
                # make_strategy checks it before TensorFlow reads TF_CONFIG (whose errors are tracebacks).
                with mock.patch.dict(os.environ, {'TF_CONFIG': tf_config}):
                    with self.assertRaisesRegex(ConfigError, expected):
                        strategy.make_strategy('multi_worker')

    def test_the_tf_configs_tensorflow_takes_pass_the_check(self):
        for tf_config in (None, '', cluster.tf_config(['10.0.0.1:2222', '10.0.0.2:2222'], 1),
                          '{"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "chief", "index": 0}}',
                          '{"cluster": {"worker": {"1": "b:1"}}, "task": {"type": "worker", "index": "1"}}',
                          '{"cluster": {"worker": ["[::1]:2222"]}, "task": {"type": "worker", "index": 0}}',
                          '{"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}}'):
            cluster.check_tf_config(tf_config)


if __name__ == '__main__':
    tf.test.main()
