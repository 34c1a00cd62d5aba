"""Every Python example in README.md and docs/*.md runs as written.

The ```python blocks of one Markdown file run in order in one namespace (a later block may use
names an earlier one defined), in a fresh Python process per file, on a one-device CPU machine:
the child gets no ``--xla_force_host_platform_device_count`` flag and ``JAX_PLATFORMS=cpu``.
A failure names the file and the Markdown line of the failing statement.

Markers, an HTML comment on the line right before a block's opening fence (invisible in the
rendered page):

* ``<!-- example: own-process -->``: the block runs alone in its own process (it sets
  ``XLA_FLAGS``, e.g. for several host devices, before it imports JAX).
* ``<!-- example: needs-nixl -->``: the block runs in order with the others where NIXL is
  installed (as the transfer tests, it is not run without NIXL, and the test reports itself
  skipped then).
* ``<!-- example: skip REASON -->``: the block is not run here (e.g. it needs a GPU). Keep such
  blocks few; the reason is required.

Blocks fenced as anything other than ``python`` (``bash``, ``text``, ...) are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

from absl.testing import absltest, parameterized

from jaxkv.transfer import nixl_available

# The source tree: the real location of this file (under Bazel the test is a symlink in the
# runfiles tree, whose target is the checked-out file).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
TIMEOUT_S = 240
_MARKER = re.compile(r"^<!--\s*example:\s*(own-process|needs-nixl|skip)\b\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")

# Runs the blocks it reads from stdin (JSON: [[file, line, code], ...]) in one namespace; a
# block's code is compiled as `file` with its Markdown line numbers.
_RUNNER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(sys.stdin)
    namespace = {"__name__": "__main__"}
    for path, line, code in blocks:
        try:
            exec(compile("\\n" * (line - 1) + code, path, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"EXAMPLE FAILED: the block at {path}:{line}", file=sys.stderr)
            sys.exit(1)
        print(f"EXAMPLE OK: {path}:{line}", flush=True)
""")


def markdown_files() -> list[str]:
    """README.md and docs/**/*.md, relative to the repository root."""
    files = ["README.md"]
    docs = os.path.join(ROOT, "docs")
    for directory, _, names in sorted(os.walk(docs)):
        for name in sorted(names):
            if name.endswith(".md"):
                files.append(os.path.relpath(os.path.join(directory, name), ROOT))
    return files


def python_blocks(path: str) -> list[dict]:
    """The ```python blocks of a Markdown file (relative to the repository root)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return parse_blocks(f.read(), path)


def parse_blocks(text: str, path: str) -> list[dict]:
    """The ```python blocks of Markdown `text`: ``line`` (first code line, 1-based), ``code``,
    ``mode`` ("shared", "needs-nixl", "own-process" or "skip") and ``reason``.

    Raises:
      ValueError: an unterminated fence, a marker not followed by a python block, or a skip
        without a reason.
    """
    lines = text.splitlines()
    blocks, pending, i = [], None, 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        if marker:
            pending = (marker.group(1), marker.group(2), i + 1)
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if fence is None:
            if pending is not None and lines[i].strip():
                raise ValueError(f"{path}:{pending[2]}: example marker not followed by a fence")
            i += 1
            continue
        ticks, language = fence.group(1), fence.group(2).lower()
        start = i + 1
        end = start
        while end < len(lines) and not lines[end].startswith(ticks):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: unterminated code fence")
        if language in ("python", "py"):
            mode, reason = ("shared", "") if pending is None else pending[:2]
            if mode == "skip" and not reason:
                raise ValueError(f"{path}:{pending[2]}: a skipped example needs a reason")
            blocks.append(dict(line=start + 1, code="\n".join(lines[start:end]) + "\n",
                               mode=mode, reason=reason))
        elif pending is not None:
            raise ValueError(f"{path}:{pending[2]}: example marker before a {language!r} block")
        pending = None
        i = end + 1
    return blocks


def child_environment() -> dict[str, str]:
    """The environment of an example process: one CPU device, the parent's packages."""
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = flags
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("UCX_TLS", "tcp,sm,self")  # NIXL loopback between engines of one process
    # The parent's import path (the installed jaxkv, or Bazel's runfiles), never the source
    # tree, which lacks the compiled modules.
    path = [p for p in sys.path if p and os.path.realpath(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def run_blocks(path: str, blocks: list[dict]) -> str:
    """Runs blocks in one fresh process; returns its output or raises AssertionError."""
    payload = json.dumps([[path, b["line"], b["code"]] for b in blocks])
    with tempfile.TemporaryDirectory() as workdir:
        try:
            done = subprocess.run(
                [sys.executable, "-P", "-c", _RUNNER], input=payload, capture_output=True,
                text=True, cwd=workdir, env=child_environment(), timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise AssertionError(f"the examples of {path} ran over {TIMEOUT_S} s:\n"
                                 f"{error.stdout or ''}{error.stderr or ''}") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(f"an example of {path} failed (exit {done.returncode}):\n"
                             f"{output[-6000:]}")
    return output


FILES = markdown_files()


class CollectorTest(absltest.TestCase):
    def test_collects_blocks_markers_and_lines(self):
        text = textwrap.dedent("""\
            # t
            ```python
            x = 1
            ```
            ```bash
            echo no
            ```
            <!-- example: skip needs a GPU -->
            ```python
            import cupy
            ```
            <!-- example: own-process -->
            ````python
            y = 2
            ````
            <!-- example: needs-nixl -->
            ```python
            z = 3
            ```
            """)
        blocks = parse_blocks(text, "t.md")
        self.assertEqual([(b["line"], b["mode"], b["code"]) for b in blocks],
                         [(3, "shared", "x = 1\n"), (10, "skip", "import cupy\n"),
                          (14, "own-process", "y = 2\n"), (18, "needs-nixl", "z = 3\n")])
        self.assertEqual(blocks[1]["reason"], "needs a GPU")
        with self.assertRaisesRegex(ValueError, "t.md:1: a skipped example needs a reason"):
            parse_blocks("<!-- example: skip -->\n```python\nx\n```\n", "t.md")
        with self.assertRaisesRegex(ValueError, "unterminated"):
            parse_blocks("```python\nx\n", "t.md")

    def test_a_failing_block_is_reported_with_its_line(self):
        with self.assertRaisesRegex(AssertionError, r"x\.md:7"):
            run_blocks("x.md", [dict(line=2, code="a = 1\n"),
                                dict(line=7, code="assert a == 2, 'wrong'\n")])

    def test_every_page_is_collected(self):
        self.assertIn("README.md", FILES)
        self.assertIn(os.path.join("docs", "data-movement.md"), FILES)
        counts = {path: len(python_blocks(path)) for path in FILES}
        self.assertGreaterEqual(counts["README.md"], 5, counts)
        self.assertGreater(sum(counts.values()), 20, counts)


class DocsExamplesTest(parameterized.TestCase):
    @parameterized.named_parameters(
        (re.sub(r"\W", "_", path), path) for path in FILES if python_blocks(path))
    def test_examples_run(self, path):
        blocks = python_blocks(path)
        have_nixl = nixl_available()
        shared = [b for b in blocks
                  if b["mode"] == "shared" or (b["mode"] == "needs-nixl" and have_nixl)]
        if shared:
            output = run_blocks(path, shared)
            self.assertEqual(output.count("EXAMPLE OK:"), len(shared), output[-3000:])
        for block in blocks:
            if block["mode"] == "own-process":
                run_blocks(path, [block])
        skipped = [f"{path}:{b['line']} ({b['reason']})" for b in blocks if b["mode"] == "skip"]
        if skipped:
            print("skipped examples:", "; ".join(skipped))
        if not have_nixl and any(b["mode"] == "needs-nixl" for b in blocks):
            self.skipTest(f"the NIXL examples of {path} need NIXL (nixl-cu13), not installed")


if __name__ == "__main__":
    absltest.main()
