"""hfcompress: LISA attention sharing + FASC low-rank compression for Llama-family models on the Hub."""

__version__ = "0.1.0"
