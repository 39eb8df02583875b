"""fivefold: train Llama-style models with the five parallel dimensions, and plan the layout first."""

__version__ = "0.1.0"
