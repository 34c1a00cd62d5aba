"""Every tests/**/*_test.py must run its tests when executed as a script.

Bazel runs each test file as a script (`python tests/ops/ops_test.py`): a file without
`absltest.main()` under `if __name__ == "__main__":` would exit 0 having run nothing, and Bazel
would call it PASSED.
"""

import ast
import glob
import os
import sys
import unittest


def _calls_main_under_guard(tree):
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        test = ast.unparse(node.test).replace("'", '"')
        if test not in ('__name__ == "__main__"', '"__main__" == __name__'):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                name = ast.unparse(sub.func)
                if name.endswith("main") or name.endswith("run_tests"):
                    return True
    return False


class TestFilesHaveMainTest(unittest.TestCase):

    def test_every_test_file_runs_as_a_script(self):
        # tests/integrations/ runs under pytest in its own environment, not under Bazel.
        files = sorted(
            path for path in glob.glob(os.path.join("tests", "**", "*_test.py"), recursive=True)
            if not path.startswith(os.path.join("tests", "integrations", ""))
        )
        if not files:
            self.skipTest("no tests/**/*_test.py yet")
        missing = []
        for path in files:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            if not _calls_main_under_guard(tree):
                missing.append(path)
        self.assertEqual(
            missing, [],
            "these files do not end in `if __name__ == \"__main__\": absltest.main()`, so "
            "Bazel would run none of their tests")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
