"""The link constants of a calibrated profile: a ring all-reduce's per-step latency and bus bandwidth fitted to
the measured all-reduce times."""

from __future__ import annotations


def fit_link(rows: list[list[float]], size: int) -> tuple[float, float]:
    """Per-step latency (s) and bus bandwidth (bytes/s) of a ring all-reduce that best fit measured (bytes,
    seconds): t = 2 (n - 1) latency + 2 (n - 1) / n bytes / bandwidth, least squares on relative error."""
    steps, frac = 2 * (size - 1), 2 * (size - 1) / size
    # t / t_i = a * steps / t_i + c * frac * b_i / t_i with a = latency, c = 1 / bandwidth; weights 1 / t_i
    s11 = s12 = s22 = r1 = r2 = 0.0
    for nbytes, seconds in rows:
        x1, x2 = steps / seconds, frac * nbytes / seconds
        s11, s12, s22 = s11 + x1 * x1, s12 + x1 * x2, s22 + x2 * x2
        r1, r2 = r1 + x1, r2 + x2
    det = s11 * s22 - s12 * s12
    latency = (r1 * s22 - r2 * s12) / det if det else 0.0
    inv_bw = (s11 * r2 - s12 * r1) / det if det else 0.0
    if latency <= 0 or inv_bw <= 0:  # one term explains it all: keep the other small but positive
        latency = max(latency, min(s for _, s in rows) / steps * 0.01)
        inv_bw = max(inv_bw, 1e-12)
    return latency, 1 / inv_bw
