"""The pipeline schedule diagrams in docs/parallelism.md are what the code draws (`schedules.timeline` of the real
action lists), so they cannot go stale: each block follows a marker `<!-- timeline: NAME pp=P m=M v=V -->`."""

from __future__ import annotations

import re
from pathlib import Path

from fivefold.parallel.schedules import SCHEDULES, build_schedule, timeline

DOC = Path(__file__).resolve().parents[1] / "docs" / "parallelism.md"
BLOCK = re.compile(r"<!-- timeline: (\S+) pp=(\d+) m=(\d+) v=(\d+) -->\n```\n(.*?)\n```", re.S)


def test_schedule_diagrams_in_the_docs_are_drawn_from_the_schedules():
    blocks = BLOCK.findall(DOC.read_text())
    assert sorted(name for name, *_ in blocks) == sorted(SCHEDULES)  # one diagram per schedule
    for name, p, m, v, text in blocks:
        expected = timeline(build_schedule(name, int(p), int(m), int(v)))
        assert text == expected, f"the {name} diagram in {DOC.name} is stale; the code draws:\n{expected}"
