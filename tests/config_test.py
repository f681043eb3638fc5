"""Config: one source per setting. Each field's metadata drives the flags, the help and the validation."""

import dataclasses
import typing

from absl import flags
from absl.testing import parameterized
import tensorflow as tf

from imagenet_tpu import config as config_lib
from imagenet_tpu.commands import common
from imagenet_tpu.commands import train as main  # noqa: F401  (defines the flags)
from imagenet_tpu.config import Config, ConfigError

FIELDS = {field.name: field for field in dataclasses.fields(Config)}


class ConfigMetadataTest(tf.test.TestCase, parameterized.TestCase):

    def test_every_field_has_help_a_section_and_a_flag_with_its_default(self):
        for name, field in FIELDS.items():
            self.assertIn(field.metadata['section'], config_lib.SECTIONS, name)
            self.assertTrue(field.metadata['help'].endswith('.'), name)
            flag = flags.FLAGS[name]
            parse = field.metadata['parse']
            flag_default = parse(flag.default) if parse and flag.default is not None else flag.default
            self.assertEqual(flag_default, field.default, name)

    def test_flags_are_exactly_the_fields_plus_absls_own(self):
        ours = {name for name, flag in flags.FLAGS._flags().items() if name == flag.name}
        defined_here = {name for name in ours if flags.FLAGS.find_module_defining_flag(name) == common.__name__}
        self.assertEqual(defined_here, set(FIELDS))

    @parameterized.parameters(*[name for name, field in FIELDS.items() if field.metadata['choices']])
    def test_choices_are_checked_from_the_metadata(self, name):
        choices = FIELDS[name].metadata['choices']
        for choice in choices:
            dataclasses.replace(Config(), **{name: choice})
        bogus = 7 if isinstance(choices[0], int) else 'bogus'
        with self.assertRaisesRegex(ConfigError, f"unknown {name} {bogus!r}; choose one of "
                                                 + ', '.join(str(choice) for choice in choices)):
            dataclasses.replace(Config(), **{name: bogus})

    @parameterized.parameters(*[name for name, field in FIELDS.items() if field.metadata['minimum'] is not None])
    def test_lower_bounds_are_checked_from_the_metadata(self, name):
        minimum = FIELDS[name].metadata['minimum']
        dataclasses.replace(Config(), **{name: minimum})
        with self.assertRaisesRegex(ConfigError, f'{name} must be at least {minimum}, got {minimum - 1}'):
            dataclasses.replace(Config(), **{name: minimum - 1})

    def test_settings_unwrap_optional_types(self):
        kinds = dict((field.name, kind) for field, kind in config_lib.settings())
        self.assertIs(kinds['total_steps'], int)
        self.assertIs(kinds['jit_compile'], bool)
        self.assertEqual(typing.get_args(kinds['lr_decay_epochs']), (float, Ellipsis))

    def test_mesh_shape_and_lists_parse_or_fail_in_one_line(self):
        self.assertEqual(config_lib.parse_mesh_shape('16x32'), (16, 32))
        self.assertIsNone(config_lib.parse_mesh_shape(''))
        with self.assertRaisesRegex(ConfigError, 'must look like 16x32'):
            config_lib.parse_mesh_shape('16by32')
        self.assertEqual(config_lib.parse_floats(['30', '60.5']), (30.0, 60.5))
        self.assertEqual(config_lib.parse_floats('30,60'), (30.0, 60.0))
        with self.assertRaisesRegex(ConfigError, 'comma-separated list of numbers'):
            config_lib.parse_floats(['30', 'sixty'])

    def test_derived_quantities(self):
        config = Config(num_train_images=1281167, global_batch_size=65536, num_eval_images=50000,
                        eval_batch_size=65536)
        self.assertEqual(config.steps_per_epoch, 20)                  # round(19.55)
        self.assertEqual(config.epochs_to_steps(88.9), 1738)          # the v0.7 recipe's steps
        self.assertEqual(config.peak_learning_rate, 0.1 * 65536 / 256)
        self.assertEqual(Config(image_size=128, eval_crop_padding=32).eval_crop, 0.8)
        # 50,000 images over 3 hosts: the largest share is 16,667, at 65536 // 3 images per host-step.
        self.assertEqual(config.eval_steps_for(3), 1)


if __name__ == '__main__':
    tf.test.main()
