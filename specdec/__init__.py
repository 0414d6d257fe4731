"""specdec: train speculative-decoding drafters against a frozen target and measure them."""

__version__ = "0.1.0"
