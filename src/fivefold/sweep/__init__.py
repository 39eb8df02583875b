"""Sweeps: a grid of layouts (`grid`), run one by one as their own process groups, locally or under SLURM
(`runner`), recorded in a SQLite results store (`store`) by `fivefold sweep` (`cli`), and drawn by
`fivefold report` (`report`)."""
