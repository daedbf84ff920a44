"""Loads the suite's pytest plugin (`conformance/suite/pytest_plugin.py`) for a run that reaches these
properties without `-p conformance.suite.pytest_plugin`.

`pytest_plugins = [...]` is refused in a conftest below the rootdir, and importing the hooks here
would register them a second time whenever the plugin was also given with `-p` (a duplicated
`--backends` option, every property parametrized twice). So this conftest registers the plugin
module itself, once, as soon as pytest reads it. Read early (`pytest conformance/...` from the
repository), that is before the command line is parsed and `--backends`/`--devices` work; read
during collection (`--pyargs` from elsewhere), the properties are still parametrized, but the
options need `-p conformance.suite.pytest_plugin`, which `rosetta conformance` always passes.
"""

from conformance.suite import pytest_plugin

PLUGIN = "conformance.suite.pytest_plugin"


def pytest_addoption(parser, pluginmanager):
    if pluginmanager.get_plugin(PLUGIN) is None and not pluginmanager.is_registered(pytest_plugin):
        pluginmanager.register(pytest_plugin, PLUGIN)
