"""--cluster=slurm: the cluster of a Slurm job step through TensorFlow's SlurmClusterResolver, from Slurm's
variables as srun sets them (hosts, tasks per node, GPUs bound per task or shared per node, nodes without GPUs),
and a real Slurm (Debian's slurm-wlm and munge, one node started by tools/launch/local_slurm.sh) running a
training of two tasks where Slurm is installed."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from unittest import mock

import pytest
import tensorflow as tf

import helpers
from imagenet_tpu.distribute import cluster
from imagenet_tpu.errors import ConfigError

SCRIPT = os.path.join(helpers.REPO, 'tools', 'launch', 'local_slurm.sh')


def step(procid: int, nodelist: str, tasks_per_node: str, tasks: int, **extra) -> dict:
    """The variables srun gives task ``procid`` of a job step."""
    return {'SLURM_PROCID': str(procid), 'SLURM_STEP_NODELIST': nodelist, 'SLURM_STEP_TASKS_PER_NODE': tasks_per_node,
            'SLURM_STEP_NUM_TASKS': str(tasks), 'SLURM_STEP_ID': '0', **extra}


class SlurmVariablesTest(tf.test.TestCase):

    def config_of(self, variables: dict, port: int = 8888):
        """(TF_CONFIG as a dict, CUDA_VISIBLE_DEVICES after) of a task with ``variables``, in a clean environment."""
        environment = {name: value for name, value in os.environ.items()
                       if not name.startswith('SLURM_') and name not in ('TF_CONFIG', 'CUDA_VISIBLE_DEVICES')}
        with mock.patch.dict(os.environ, {**environment, **variables}, clear=True):
            text = cluster.cluster_config('slurm', port)
            return json.loads(text), os.environ.get('CUDA_VISIBLE_DEVICES')

    def test_tasks_per_node_as_slurm_writes_them(self):
        self.assertEqual(cluster.tasks_per_node('2(x3),1'), [2, 2, 2, 1])
        self.assertEqual(cluster.tasks_per_node('4'), [4])

    def test_two_nodes_of_two_tasks_without_gpus(self):
        # Slurm's block distribution: tasks 0, 1 on node01, 2, 3 on node02; the resolver numbers the ports of
        # each node's tasks from the base.
        for procid in range(4):
            value, gpus = self.config_of(step(procid, 'node[01-02]', '2(x2)', 4), port=9000)
            self.assertEqual(value['cluster']['worker'], ['node01:9000', 'node01:9001', 'node02:9000', 'node02:9001'])
            self.assertEqual(value['task'], {'type': 'worker', 'index': procid})
            self.assertIsNone(gpus)          # nothing to set on a node without GPUs

    def test_gpus_bound_per_task_are_kept_and_node_gpus_are_shared(self):
        # --gpus-per-task=2: Slurm sets each task's CUDA_VISIBLE_DEVICES itself; it stays as Slurm set it.
        bound = step(1, 'gpu7', '2', 2, SLURM_GPUS_PER_TASK='a100:2', CUDA_VISIBLE_DEVICES='0,1')
        self.assertEqual(cluster.slurm_gpus(bound), (4, 2, False))
        value, gpus = self.config_of(bound)
        self.assertEqual((value['task']['index'], gpus), (1, '0,1'))
        # --gres=gpu:4 for the node, 2 tasks: the resolver gives task 1 the node's GPUs 2 and 3.
        shared = step(1, 'gpu7', '2', 2, SLURM_GPUS_ON_NODE='4')
        self.assertEqual(cluster.slurm_gpus(shared), (4, 2, True))
        self.assertEqual(self.config_of(shared)[1], '2,3')
        self.assertEqual(self.config_of(step(0, 'gpu7', '2', 2, SLURM_GPUS_ON_NODE='4'))[1], '0,1')

    def test_each_task_sees_its_own_gpus_when_tensorflow_first_lists_them(self):
        # Node GPUs shared by 2 tasks (--gres=gpu:8): what each task's CUDA_VISIBLE_DEVICES is at the moment the
        # command's start-up first lists TensorFlow's devices, against what TensorFlow's own resolver allocates.
        probe = textwrap.dedent('''
            import json, os, sys
            from imagenet_tpu import runtime
            seen, importing = [], runtime.import_tensorflow

            def import_tensorflow():     # TensorFlow is imported and lists its devices in here, once
                seen.append((os.environ.get('CUDA_VISIBLE_DEVICES'), 'tensorflow' in sys.modules))
                return importing()

            runtime.import_tensorflow = import_tensorflow
            from imagenet_tpu.commands import common
            assert seen[0][1] is False, 'TensorFlow was imported before the start-up listed its devices'
            print(json.dumps(seen[0][0]))
            ''')
        for procid in (2, 3):      # the two tasks of the second node (the first node's are the same arithmetic)
            variables = step(procid, 'gpu[1-2]', '2(x2)', 4, SLURM_GPUS_ON_NODE='8', SLURM_LOCALID=str(procid % 2))
            environment = {name: value for name, value in helpers.subprocess_environment().items()
                           if not name.startswith('SLURM_') and name not in ('TF_CONFIG', 'CUDA_VISIBLE_DEVICES')}
            result = subprocess.run([sys.executable, '-c', probe], env={**environment, **variables},
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            first_listed = json.loads(result.stdout.strip().splitlines()[-1])
            self.assertEqual(first_listed, self.config_of(variables)[1])      # TensorFlow's resolver
            self.assertEqual(first_listed, '0,1,2,3' if procid % 2 == 0 else '4,5,6,7')
        # Bound by Slurm (--gpus-per-task) or under a TF_CONFIG cluster: left alone.
        bound = step(1, 'gpu7', '2', 2, SLURM_GPUS_PER_TASK='2', SLURM_LOCALID='1', CUDA_VISIBLE_DEVICES='0,1')
        self.assertEqual(cluster.bind_slurm_gpus(dict(bound)), '')
        given = step(1, 'gpu7', '2', 2, SLURM_GPUS_ON_NODE='4', SLURM_LOCALID='1', TF_CONFIG='{}')
        self.assertEqual(cluster.bind_slurm_gpus(dict(given)), '')
        self.assertEqual(cluster.bind_slurm_gpus(dict(given, TF_CONFIG='')), '2,3')

    def test_auto_prefers_tf_config_and_slurm_outside_srun_is_one_error(self):
        given = cluster.tf_config(['a:1', 'b:2'], 1)
        with mock.patch.dict(os.environ, {**step(0, 'n1', '1', 1), 'TF_CONFIG': given}):
            self.assertEqual(cluster.cluster_config('auto'), given)
        environment = {name: value for name, value in os.environ.items() if not name.startswith('SLURM_')}
        with mock.patch.dict(os.environ, environment, clear=True):
            with self.assertRaisesRegex(ConfigError, 'outside a Slurm job step .* start the command with srun'):
                cluster.cluster_config('slurm')
            self.assertEqual(cluster.cluster_config('auto'), os.environ.get('TF_CONFIG'))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which('srun') is None or not (shutil.which('slurmctld') or os.path.exists(
    '/usr/sbin/slurmctld')), reason='Slurm is not installed (Debian: apt-get install slurm-wlm munge)')
class RealSlurmTest(tf.test.TestCase):

    def test_srun_of_two_tasks_trains_one_pod_of_two_workers(self):
        root = tempfile.mkdtemp(prefix='slurm-', dir=self.get_temp_dir())
        folder, data_dir, model_dir = (os.path.join(root, name) for name in ('slurm', 'data', 'run'))
        helpers.write_dataset(data_dir)
        started = subprocess.run(['bash', SCRIPT, 'start', folder], capture_output=True, text=True, timeout=120)
        self.assertEqual(started.returncode, 0, started.stderr)
        environment = helpers.subprocess_environment(SLURM_CONF=os.path.join(folder, 'slurm.conf'))
        environment = {name: value for name, value in environment.items() if name != 'TF_CONFIG'}
        try:
            port = cluster.free_ports(1)[0]
            process = subprocess.run(
                ['srun', '--ntasks=2', '--label', '--kill-on-bad-exit=1', sys.executable, '-m',
                 'imagenet_tpu.commands.train', '--strategy=multi_worker', '--cluster=slurm', f'--cluster_port={port}',
                 f'--data_dir={data_dir}', f'--model_dir={model_dir}', '--total_steps=4', '--checkpoint_every_steps=4',
                 *helpers.small_run_flags(global_batch_size=8, eval_batch_size=8, cpu_devices_per_worker=2,
                                          bn_group_size=4, log_every_steps=2)],
                capture_output=True, text=True, env=environment, timeout=300)
        finally:
            subprocess.run(['bash', SCRIPT, 'stop', folder], capture_output=True, timeout=60)
        output = process.stdout + process.stderr
        self.assertEqual(process.returncode, 0, output[-3000:])
        for task in range(2):
            found = re.search(rf'^{task}: Slurm task {task} of 2: workers (\S+):{port}, (\S+):{port + 1}$', output,
                              re.MULTILINE)
            self.assertIsNotNone(found, output[-3000:])
            self.assertIn(f'{task}: 10-layer ResNet, 4 replicas', output)
        with open(os.path.join(model_dir, 'results.json')) as f:
            results = json.load(f)
        self.assertEqual((results['replicas'], results['input_pipelines'], results['steps'], results['eval_images']),
                         (4, 2, 4, 20))
        self.assertEqual(helpers.latest_checkpoint_step(os.path.join(model_dir, 'checkpoints')), 4)
        self.assertEqual([name for name in os.listdir(model_dir) if 'worker' in name], [])
