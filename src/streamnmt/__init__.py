"""streamnmt: Transformer neural machine translation training whose loop keeps the GPU busy."""

__version__ = "0.1.0"
