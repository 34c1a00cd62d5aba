"""pytest glue for the absltest suites: absl flags are not parsed under pytest."""

from absl import flags


def pytest_configure(config):
    del config
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
