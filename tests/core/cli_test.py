"""The command-line programs as a user meets them: `--help` lists each program's own flags,
progress output suits the stream (a bar on a terminal, plain lines in a pipe), no backend-
probing noise, and `python -m jaxkv` works from the repository root of a development install
(or names the cause when a source tree without compiled modules shadows the package)."""

import doctest
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys

from absl.testing import absltest, parameterized

from jaxkv import _cliutil

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BIN = os.path.dirname(sys.executable)
# The smallest `jaxkv` run: 2 host devices, one layer, a few blocks, one timed iteration.
_TINY = ["--num_blocks=16", "--num_ids=4", "--iters=1", "--num_layers=1", "--num_kv_heads=2",
         "--head_dim=8", "--cpu_devices=2"]


def _run(args, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env, stdin=subprocess.DEVNULL)


def _flag_help(module_name: str) -> dict[str, str]:
    """The flags `module_name` defines and their help strings, read from a fresh process
    (the two CLIs define flags of the same names, so they cannot share this one)."""
    code = (
        "import importlib, json, sys; from absl import flags; "
        f"importlib.import_module({module_name!r}); "
        f"print(json.dumps({{f.name: f.help for f in "
        f"flags.FLAGS.get_flags_for_module({module_name!r})}}))"
    )
    proc = _run([sys.executable, "-P", "-c", code], cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _editable_install() -> bool:
    try:
        direct_url = importlib.metadata.distribution("jaxkv").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    return bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))


class HelpTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("jaxkv_script", ["jaxkv"], "jaxkv._cli"),
        ("jaxkv_module", ["-m", "jaxkv"], "jaxkv._cli"),
        ("demo_script", ["jaxkv-demo"], "jaxkv.demo._cli"),
        ("demo_module", ["-m", "jaxkv.demo"], "jaxkv.demo._cli"),
    )
    def test_help_lists_the_programs_flags(self, command, module_name):
        if command[0] == "-m":
            args = [sys.executable, "-P", *command, "--help"]
        else:
            args = [os.path.join(_BIN, command[0]), "--help"]
            if not os.path.exists(args[0]):
                self.skipTest(f"console script {args[0]} is not installed")
        proc = _run(args, cwd="/")
        self.assertNotIn("Traceback", proc.stderr)  # absl's --help exits with status 1
        out = " ".join(proc.stdout.split())  # absl wraps long help lines
        expected = _flag_help(module_name)
        self.assertGreater(len(expected), 10)
        for name, text in expected.items():
            self.assertRegex(out, rf"--(\[no\])?{name}: ")
            self.assertIn(" ".join(text.split()), out)
        self.assertIn("Example:", out)  # the program's docstring heads the usage text
        self.assertNotIn("--xla_", out)  # --helpfull material stays out


class ProgressTest(absltest.TestCase):
    def test_plain_lines_when_not_a_terminal(self):
        out = io.StringIO()
        show = _cliutil.Progress(3, stream=out)
        show(0, "0/3 requests")
        show(0, "0/3 requests")
        show(2, "2/3 requests")
        show(3, "3/3 requests")
        text = out.getvalue()
        self.assertNotIn("\r", text)
        lines = text.splitlines()
        self.assertLen(lines, 3)  # the repeated state is not written again
        for line, state in zip(lines, ["0/3", "2/3", "3/3"]):
            self.assertTrue(line.startswith(f"[progress] {state} requests "), line)

    def test_bar_redrawn_in_place_on_a_terminal(self):
        class Terminal(io.StringIO):
            def isatty(self):
                return True

        out = Terminal()
        show = _cliutil.Progress(4, stream=out, width=8)
        show(2, "2/4")
        show(4, "4/4")
        text = out.getvalue()
        self.assertEqual(text.count("\r"), 2)
        self.assertIn("[####....] 2/4", text)
        self.assertIn("[########] 4/4", text)
        self.assertTrue(text.endswith("\n"))
        self.assertEqual(text.count("\n"), 1)

    def test_disabled_writes_nothing(self):
        out = io.StringIO()
        _cliutil.Progress(1, stream=out, enabled=False)(1, "1/1")
        self.assertEqual(out.getvalue(), "")


class StartupTest(absltest.TestCase):
    def test_no_backend_probe_noise_even_when_verbose(self):
        env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
        proc = _run([sys.executable, "-P", "-m", "jaxkv", *_TINY, "--verbosity=0"], cwd="/",
                    env=env)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("bytes match numpy reference: True", proc.stdout)
        self.assertNotIn("Unable to initialize backend", proc.stderr)

    def test_demo_with_vllm_scheduler_names_the_missing_dependency(self):
        if importlib.util.find_spec("vllm") is not None:
            self.skipTest("vLLM is installed here (tests/integrations run this mode)")
        proc = _run([sys.executable, "-P", "-m", "jaxkv.demo", "--serve_with=vllm-scheduler"],
                    cwd="/")
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        self.assertIn("--serve_with=vllm-scheduler needs vLLM installed", proc.stderr)

    def test_runs_from_the_repository_root(self):
        if not _editable_install():
            self.skipTest("jaxkv is not installed in development (editable) mode")
        proc = _run([sys.executable, "-m", "jaxkv", *_TINY], cwd=_REPO)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("bytes match numpy reference: True", proc.stdout)

    def test_source_tree_without_compiled_modules_is_named(self):
        # A copy of the sources (no compiled modules) in the working directory shadows the
        # installed package; the development install's import redirect is taken away so the
        # copy is what `import jaxkv` finds.
        tmp = self.create_tempdir().full_path
        shutil.copytree(os.path.join(_REPO, "jaxkv"), os.path.join(tmp, "jaxkv"),
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        code = (
            "import runpy, sys; "
            "sys.meta_path[:] = [f for f in sys.meta_path "
            "if not type(f).__module__.startswith('_editable')]; "
            f"sys.argv = ['jaxkv', *{_TINY!r}]; "
            "runpy.run_module('jaxkv', run_name='__main__')"
        )
        proc = _run([sys.executable, "-c", code], cwd=tmp)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("has no compiled module jaxkv._ffi_cpu", proc.stderr)
        self.assertIn("source tree in the current directory", proc.stderr)
        self.assertIn(f"imported from {os.path.realpath(tmp)}{os.sep}jaxkv ", proc.stderr)


class DocstringExamplesTest(parameterized.TestCase):
    @parameterized.parameters("jaxkv._cliutil", "jaxkv.demo._report")
    def test_examples(self, module_name):
        result = doctest.testmod(importlib.import_module(module_name), verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


if __name__ == "__main__":
    absltest.main()
