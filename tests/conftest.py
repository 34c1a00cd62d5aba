"""pytest glue for the absltest suites."""

from absl import flags
from support import platforms

# Sharding tests need several CPU devices; the flag must be set before JAX starts.
platforms.force_cpu_devices()


def pytest_configure(config):
    del config
    # absl flags are not parsed under pytest; absltest helpers (create_tempdir) need them.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
