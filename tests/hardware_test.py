"""The one hardware catalogue: a name is known to both the configuration and the planner, or refused by both."""

from absl.testing import parameterized
import tensorflow as tf

from imagenet_tpu import hardware
from imagenet_tpu.config import Config, ConfigError
from imagenet_tpu.plan import planner


def _every_topology():
    names = [f'{generation}-{8 if unit == "cores" else 4}'
             for generation, (unit, _) in hardware.TPU_GENERATIONS.items()]
    return names + [f'8x{model}' for model in hardware.GPU_MODELS]


class HardwareTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(*_every_topology())
    def test_a_name_the_config_accepts_has_the_planner_facts(self, name):
        topology = Config(topology=name).topology and hardware.parse_topology(name)
        chip = hardware.chip(topology.chip)
        self.assertGreater(chip.peak_tflops, 0)
        self.assertGreater(chip.chips_per_host, 0)

    @parameterized.parameters('v9-8', '8xB300', 'v3-7', 'tpu')
    def test_a_name_refused_by_the_config_is_refused_by_the_planner(self, name):
        with self.assertRaises(ConfigError):
            Config(topology=name)
        with self.assertRaises(ConfigError):    # what the planner parses the name with
            hardware.parse_topology(name)

    def test_v6e_is_planned(self):
        config = Config(depth=18, image_size=64, global_batch_size=256, strategy='default', topology='v6e-8')
        self.assertEqual(hardware.parse_topology('v6e-8'), hardware.Topology('tpu', 'v6e', 8, 1, 8))
        self.assertEqual(hardware.parse_topology('v6e-256').hosts, 256 // hardware.CHIPS['v6e'].chips_per_host)
        plan = planner.plan(config)
        self.assertGreater(plan['images_per_second'], 0)


if __name__ == '__main__':
    tf.test.main()


class HostsTest(tf.test.TestCase):

    def test_v5e_and_v6e_slices_may_come_in_hosts_of_8_chips(self):
        # v6e-256: planned as 64 hosts of 4 chips; 32 hosts of 8 chips is the same slice and must not be refused.
        self.assertEqual(hardware.parse_topology('v6e-256').hosts, 64)
        self.assertEqual(hardware.fewest_hosts('v6e-256'), 32)
        self.assertEqual(Config(topology='v5litepod-64', strategy='tpu', tpu='pod').topology_hosts, 8)
        self.assertEqual(hardware.fewest_hosts('v6e-8'), 1)
        self.assertEqual(hardware.fewest_hosts('v3-1024'), hardware.parse_topology('v3-1024').hosts)   # 4 chips a host
        self.assertEqual(hardware.fewest_hosts('4x8xA100'), 4)
