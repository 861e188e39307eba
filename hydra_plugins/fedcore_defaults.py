"""Makes ``${default:<kind>}`` (flows/config/defaults.py) known wherever Hydra composes conf/.

Hydra imports every module under ``hydra_plugins`` when it starts. DVC composes conf/ in its own process
to write params.yaml for ``dvc exp run -S`` (with the repository root on the plug-in path), and resolves
the result there: without this, every interpolation of a library default would be unknown to it.
"""

from flows.config.defaults import register

register()
