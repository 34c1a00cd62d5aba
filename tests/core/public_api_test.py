"""jaxkv's public API (issue 28, step 6): every package's ``__all__`` is exactly its public
namespace, all of them together stay small, the deprecated names of the last release warn and
are listed in the docs, and the API reference pages document exactly the public names."""

import doctest
import importlib
import inspect
import os
import re
import warnings

from absl.testing import absltest, parameterized

import jaxkv
from jaxkv import _deprecation

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("jaxkv", "jaxkv.blocks", "jaxkv.transfer", "jaxkv.offload", "jaxkv.ops",
            "jaxkv.integrations", "jaxkv.demo")
MAX_PUBLIC_NAMES = 80


def _public_namespace(module):
    names = {name for name in vars(module) if not name.startswith("_") or name == "__version__"}
    names -= {name for name in names if inspect.ismodule(getattr(module, name))}
    return names | set(getattr(module, "_LAZY_ATTRIBUTES", ()))


def _deprecated(module):
    return dict(getattr(module, "_DEPRECATED", {}))


def _read(relative):
    path = os.path.join(_REPO, relative)
    if not os.path.exists(path):  # e.g. under Bazel, whose runfiles hold only tests/.
        raise absltest.SkipTest(f"{relative} is not available here")
    with open(path) as handle:
        return handle.read()


class PublicApiTest(parameterized.TestCase):

    @parameterized.parameters(*PACKAGES)
    def test_all_is_the_public_namespace(self, name):
        module = importlib.import_module(name)
        self.assertEqual(sorted(module.__all__), sorted(_public_namespace(module)))
        self.assertLen(set(module.__all__), len(module.__all__))

    def test_all_names_together_stay_small(self):
        total = sum(len(importlib.import_module(name).__all__) for name in PACKAGES)
        self.assertLessEqual(total, MAX_PUBLIC_NAMES)

    @parameterized.parameters(*PACKAGES)
    def test_public_names_resolve_without_warnings(self, name):
        module = importlib.import_module(name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for public in module.__all__:
                getattr(module, public)

    @parameterized.parameters(*PACKAGES)
    def test_deprecated_names_warn_and_stay_out_of_the_namespace(self, name):
        module = importlib.import_module(name)
        for old, where in _deprecated(module).items():
            self.assertNotIn(old, module.__all__)
            self.assertNotIn(old, vars(module))
            private, _, attribute = where.partition(":")
            self.assertTrue(private.startswith(name + "._") or private.startswith("jaxkv._"),
                            f"{name}.{old} should come from a private module, not {private}")
            with self.assertWarnsRegex(DeprecationWarning, rf"{re.escape(name)}\.{old} is "):
                value = getattr(module, old)
            self.assertIs(value, getattr(importlib.import_module(private), attribute or old))
        with self.assertRaises(AttributeError):
            module.no_such_name  # noqa: B018

    def test_deprecated_names_are_listed_in_the_guide(self):
        guide = _read(os.path.join("docs", "guide.md"))
        section = guide[guide.index("## Deprecated names"):]
        for name in PACKAGES:
            for old in _deprecated(importlib.import_module(name)):
                self.assertIn(f"`{old}`", section, f"{name}.{old} is not in the guide's list")

    def test_api_pages_document_exactly_the_public_names(self):
        root = _read(os.path.join("docs", "api", "jaxkv.md"))
        documented = set(re.findall(r"^::: jaxkv\.(\w+)$", root, re.MULTILINE))
        self.assertEqual(documented, set(jaxkv.__all__) - {"__version__"})
        for name in ("blocks", "transfer", "offload", "ops"):
            page = _read(os.path.join("docs", "api", f"{name}.md"))
            # The whole package: mkdocstrings documents its __all__.
            self.assertRegex(page, rf"(?m)^::: jaxkv\.{name}$")

    def test_deprecation_helper_examples(self):
        result = doctest.testmod(_deprecation, optionflags=doctest.ELLIPSIS, verbose=False)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


if __name__ == "__main__":
    absltest.main()
