"""Work before each evaluation and at export that grows with the pod: the batch-norm statistics averaged in one
replicated step, the re-estimation function traced once, and the SavedModel exported from a twin network built
outside the strategy. Each is checked against what the package did before, on 4 logical CPU replicas whose
moving statistics differ."""

import os
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf

import helpers
from imagenet_tpu.model import batch_norm
from imagenet_tpu.training import callbacks
from imagenet_tpu.serving import export
from imagenet_tpu import builders

helpers.use_eight_cpus()


def statistics(network):
    return [v for layer in batch_norm.batch_norm_layers(network) for v in (layer.moving_mean, layer.moving_variance)]


def make_replicas_differ(network, strategy):
    """Replica r's moving statistics become (value + r) * (1 + r / 10): every replica holds other numbers."""
    def replica():
        r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        for variable in statistics(network):
            variable.assign((variable + r) * (1.0 + r / 10.0))
    strategy.run(tf.function(replica))


def per_replica(strategy, variable) -> np.ndarray:
    return np.stack([v.numpy() for v in strategy.experimental_local_results(variable)])


class EvaluationCostsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.strategy = helpers.mirrored(4)
        self.config = helpers.tiny_config(norm='batch_norm', seed=3)
        with self.strategy.scope():
            self.network = builders.build_network(self.config, 4)
        make_replicas_differ(self.network, self.strategy)

    def test_averaging_in_one_step_equals_the_assignment_from_the_host(self):
        before = [per_replica(self.strategy, v) for v in statistics(self.network)]
        self.assertGreater(np.abs(before[0][1] - before[0][0]).max(), 0.5)
        callbacks.average_moving_statistics(self.network, self.strategy)
        after = [per_replica(self.strategy, v) for v in statistics(self.network)]
        # The package's former way: each variable assigned its aggregated (mean) read from the host.
        with self.strategy.scope():
            twin = builders.build_network(self.config, 4)
        for variable, values in zip(statistics(twin), before):
            self.strategy.run(tf.function(lambda v=variable, x=tf.constant(values): v.assign(
                tf.gather(x, tf.distribute.get_replica_context().replica_id_in_sync_group))))
            with self.strategy.scope():
                variable.assign(variable.read_value())
        for values, new, old in zip(before, after, [per_replica(self.strategy, v) for v in statistics(twin)]):
            for replica in range(4):
                self.assertAllClose(new[replica], values.mean(0), rtol=1e-6, atol=1e-6)    # NumPy's mean
            self.assertAllClose(new, old, rtol=1e-6, atol=1e-6)

    def test_functions_traced_per_evaluation_stay_constant(self):
        created = []
        real_function = tf.function

        def recording(*args, **kwargs):
            made = real_function(*args, **kwargs)
            created.append(made)
            return made

        batches = helpers.equivalence_batches(steps=2, batch=16, size=16)
        data = self.strategy.experimental_distribute_dataset(batches.map(lambda x, y: (x, y)).repeat())
        average = callbacks.AverageMovingStatistics(self.network, self.strategy)
        reestimate = callbacks.ReestimateBatchNorm(self.network, data, 2, self.strategy)
        traces = []
        with mock.patch.object(tf, 'function', recording):
            for _ in range(3):
                average.on_test_begin()
                reestimate.on_test_begin()
                traces.append(sum(f.experimental_get_tracing_count() for f in created if hasattr(
                    f, 'experimental_get_tracing_count')) + len(created))
        self.assertGreater(traces[0], 0)
        self.assertEqual(traces[1], traces[0])
        self.assertEqual(traces[2], traces[0])

    def test_export_from_the_twin_equals_the_export_of_the_distributed_network(self):
        root = tempfile.mkdtemp(dir=self.get_temp_dir())
        names = [f'class {i}' for i in range(self.config.num_classes)]
        export.export_saved_model(self.network, os.path.join(root, 'distributed'), names,
                                  **builders.export_settings(self.config))
        twin = builders.build_export_network(self.config, self.network)
        export.export_saved_model(twin, os.path.join(root, 'twin'), names, **builders.export_settings(self.config))
        images = tf.constant(np.random.default_rng(0).uniform(0, 255, (6, 16, 16, 3)).astype(np.float32))
        outputs = {name: tf.saved_model.load(os.path.join(root, name)).signatures['serving_preprocessed'](
            images=images)['logits'].numpy() for name in ('distributed', 'twin')}
        self.assertAllClose(outputs['twin'], outputs['distributed'], rtol=1e-5, atol=1e-5)
        # The twin holds plain variables, on no replica's device: serving it needs no strategy's placement.
        self.assertTrue(any(isinstance(v, tf.distribute.DistributedValues) for v in self.network.variables))
        self.assertFalse(any(isinstance(v, tf.distribute.DistributedValues) for v in twin.variables))
        self.assertLen(twin.variables, len(self.network.variables))

if __name__ == '__main__':
    tf.test.main()
