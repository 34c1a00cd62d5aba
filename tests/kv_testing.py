"""The old name of the device helpers, for tests/integrations until it imports `support`
(defines nothing: `support.platforms` is the module)."""

from support.platforms import gpus  # noqa: F401
