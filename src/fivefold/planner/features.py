"""What a run uses beyond its layout, as inputs of the compute model: `fivefold plan --features` and the
`features` column of `plan validate --data` (joined with '+' there, with ',' on the command line).

* `compile`: torch.compile fuses each block's element-wise ops (norms, residual adds, rotary, SwiGLU) into
  kernels that read their inputs and write their outputs once (`Framework.fused_elementwise = "all"`); where a
  framework states what its selective recompute keeps under compile (`compiled_selective_saved_matmuls`), that.
* `float8`: the blocks' linears run float8 GEMMs (torchao, dynamic tensorwise scaling) at the device's FP8
  speed-up (`planner/devices/kernels.toml`), plus the scale and cast of each input and output gradient; the output
  layer and attention stay bf16 (`Framework.float8_linears`).
* `async-tp`: tensor-parallel all-gathers and reduce-scatters micro-pipelined with their matmuls (symmetric
  memory), so only the first of tp chunks is exposed (`Framework.async_tp`).
"""

from __future__ import annotations

import dataclasses

from fivefold.config import ConfigError, did_you_mean, shown
from fivefold.planner.layout import Framework

FEATURES = {"compile": "torch.compile (fused element-wise kernels)", "float8": "float8 linears",
            "async-tp": "async tensor parallel"}


def parse_features(text: str, where: str = "--features", sep: str = ",") -> tuple[str, ...]:
    """Feature names from `text`, each checked."""
    names = tuple(f.strip() for f in text.split(sep) if f.strip())
    unknown = [f for f in names if f not in FEATURES]
    if unknown:
        raise ConfigError(f"{where} {shown(sep.join(unknown))} is not known{did_you_mean(unknown[0], FEATURES)}; "
                          f"known features: {', '.join(FEATURES)} "
                          f"(joined with {shown(sep)})")
    return names


def runs(fw: Framework) -> tuple[str, ...]:
    """The features the framework runs (`Framework.features`)."""
    return tuple(f.strip() for f in fw.features.split(",") if f.strip())


def check_runs(fw: Framework, features: tuple[str, ...] | list[str], where: str = "--features") -> None:
    """Refuse a feature the framework does not run: the planner predicts only what the engine can execute."""
    missing = [f for f in features if f in FEATURES and f not in runs(fw)]
    if missing:
        from fivefold.planner.profile import all_frameworks

        others = [n for n, other in all_frameworks().items() if all(f in runs(other) for f in missing)]
        raise ConfigError(
            f"{where} {shown(','.join(missing))}: the {fw.name} framework does not run "
            f"{' or '.join(FEATURES[f] for f in missing)}, and the planner predicts only what a framework runs "
            f"(its profile's `features`); {fw.name} runs: {', '.join(runs(fw)) or 'none'}; frameworks whose "
            f"profiles declare {','.join(missing)}: {', '.join(others) or 'none'}")


def with_features(fw: Framework, features: tuple[str, ...] | list[str], where: str = "--features") -> Framework:
    """The framework as a run with these features runs it; a feature it does not run is refused (`check_runs`)."""
    check_runs(fw, features, where)
    changes: dict = {}
    for f in features:
        if f == "compile":
            changes["fused_elementwise"] = "all"
            if fw.compiled_selective_saved_matmuls:
                changes["selective_saved_matmuls"] = fw.compiled_selective_saved_matmuls
        elif f == "float8":
            changes["float8_linears"] = True
        elif f == "async-tp":
            changes["async_tp"] = True
        else:
            raise ConfigError(f"feature {shown(f)} is not known; known features: {', '.join(FEATURES)}")
    return dataclasses.replace(fw, **changes) if changes else fw
