"""The old name of the transfer fixtures, for tests/integrations until it imports `support`
(defines nothing: the helpers live in `support.transfer` and `support.processes`)."""

from support.processes import RemoteProcess, child_env, pause, serve_scheduler_side  # noqa: F401
from support.transfer import NumpyEngine, expected_arrays  # noqa: F401
