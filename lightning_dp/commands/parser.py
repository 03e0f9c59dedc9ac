"""The jsonargparse parsers of ``lightning-dp`` with short errors and help: moved to
:mod:`lightning_dp.config.parser` (the layer that builds a config, below the commands), and imported from here as
before.
"""

from lightning_dp.config.parser import ShortErrorParser, ShortHelpFormatter, ShortJsonParser, shorten_known_subclasses

__all__ = ["ShortErrorParser", "ShortHelpFormatter", "ShortJsonParser", "shorten_known_subclasses"]
