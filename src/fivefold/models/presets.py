"""The preset table lives in `fivefold.presets` (beside the config that resolves `model.preset`); this name stays
for existing imports."""

from fivefold.presets import PRESETS, get_preset

__all__ = ["PRESETS", "get_preset"]
