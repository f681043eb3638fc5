"""The package as users install it: a wheel built from this checkout, installed into a folder of its own and run
from another folder, where neither flags/ nor the checkout is in reach. Recipes are found by name (--recipe=NAME)
inside the installed package; training by recipe with overrides, then evaluation and classification of its
result, all through the installed copy."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import tensorflow as tf

import helpers


def _run(args, cwd, target, timeout=300):
    environment = helpers.subprocess_environment(PYTHONPATH=target)
    process = subprocess.run([sys.executable, *args], cwd=cwd, env=environment, capture_output=True, text=True,
                             timeout=timeout)
    return process.returncode, process.stdout, process.stderr


@pytest.mark.slow
class InstalledWheelTest(tf.test.TestCase):

    def test_recipes_by_name_train_evaluate_and_classify_from_the_installed_wheel(self):
        root = tempfile.mkdtemp(dir=self.get_temp_dir())
        # Removed by shutil (tf.test's own clean-up at exit fails on the copied recipes link and logs a traceback).
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        wheels, target, elsewhere = (os.path.join(root, name) for name in ('wheels', 'installed', 'elsewhere'))
        os.makedirs(elsewhere)
        # Built from a copy of the sources: pip builds in the tree it is given, and a build in the checkout
        # rewrites its build/ folder, which an editable install of the checkout may be reading from.
        source = os.path.join(root, 'source')
        shutil.copytree(helpers.REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
            '.venv*', '.git', 'build', 'data', 'runs', '*.egg-info', '__pycache__'))
        build = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--quiet', '--no-deps',
                                source, '-w', wheels], capture_output=True, text=True, timeout=300)
        self.assertEqual(build.returncode, 0, build.stderr[-3000:])
        self.assertNotIn('License classifiers are deprecated', build.stderr)
        wheel = os.path.join(wheels, next(name for name in os.listdir(wheels) if name.endswith('.whl')))
        install = subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--target', target,
                                  wheel], capture_output=True, text=True, timeout=300)
        self.assertEqual(install.returncode, 0, install.stderr[-3000:])

        code, out, _ = _run(['-c', 'import imagenet_tpu; print(imagenet_tpu.__file__)'], elsewhere, target)
        self.assertTrue(out.strip().startswith(target), out)     # the installed copy, not the checkout
        code, out, err = _run(['-m', 'imagenet_tpu.commands.train', '--recipe=list'], elsewhere, target)
        self.assertEqual(code, 0, err[-2000:])
        self.assertEqual(out.split(), sorted(name[:-4] for name in os.listdir(os.path.join(helpers.REPO, 'flags'))
                                             if name.endswith('.cfg')))

        data_dir, model_dir = os.path.join(elsewhere, 'data'), os.path.join(elsewhere, 'run')
        helpers.write_dataset(data_dir)
        code, out, err = _run(['-m', 'imagenet_tpu.commands.train', '--recipe=demo', f'--data_dir={data_dir}',
                               f'--model_dir={model_dir}', *helpers.small_run_flags(num_cpu_devices=2, total_steps=3,
                                                                                     eval_every_epochs=100)],
                              elsewhere, target)
        self.assertEqual(code, 0, err[-3000:])
        self.assertIn('10-layer ResNet, 2 replicas', out)
        self.assertTrue(os.path.isdir(os.path.join(model_dir, 'saved_model')))   # the recipe's --export_saved_model
        code, out, err = _run(['-m', 'imagenet_tpu.commands.evaluate', f'--model_dir={model_dir}'], elsewhere, target)
        self.assertEqual(code, 0, err[-3000:])
        self.assertIn('on 20 images', out + err)
        image = os.path.join(elsewhere, 'photo.jpg')
        tf.io.write_file(image, tf.io.encode_jpeg(helpers.photo_like(24, 28, seed=3)))
        code, out, err = _run(['-m', 'imagenet_tpu.commands.classify', f'--saved_model={model_dir}/saved_model',
                               image], elsewhere, target)
        self.assertEqual(code, 0, err[-3000:])
        self.assertIn('photo.jpg:', out)


if __name__ == '__main__':
    tf.test.main()
