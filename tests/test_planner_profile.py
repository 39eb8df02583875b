"""One profile format for plan, validate and calibrate; the network rules that grow with the node count."""

from __future__ import annotations

import math

import pytest

from fivefold.config import ConfigError
from fivefold.planner import comm, profile
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import NANOTRON
from fivefold.planner.validate import DEFAULT_PROFILE, load_profile


def _plan(args: list[str], capsys) -> str:
    from fivefold.cli import main

    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_validate_profile_is_read_by_plan(tmp_path, capsys):
    # the packaged profile (what `validate --fit` writes: [framework] + [hardware]) works with plan --hardware
    out = _plan(["--hardware", str(DEFAULT_PROFILE), "--model", "llama3-8b", "--global-batch", "1M",
                 "--layout", "dp=8,mbs=1,zero=1", "--json"], capsys)
    assert '"fits"' in out
    fw, hw = load_profile(None)
    assert fw.name == "nanotron" and hw.busbw_gbps == get_cluster("h100-efa").busbw_gbps
    assert fw.activation_scale != NANOTRON.activation_scale  # the fitted value, not the default
    # written again, read back: the same framework and hardware
    path = tmp_path / "fitted.toml"
    profile.write(path, fw, hw, "h100-efa", "test")
    fw2, hw2 = profile.load(path, None, "h100")
    assert fw2 == fw
    assert hw2.matmul_efficiency == hw.matmul_efficiency and hw2.pp_sync_us_per_node == hw.pp_sync_us_per_node
    assert hw2.busbw_gbps == hw.busbw_gbps


def test_flat_profile_with_framework_table(tmp_path, capsys):
    # calibrate's flat format plus a [framework] table: plan takes the framework from the profile
    path = tmp_path / "p.toml"
    path.write_text('base = "h100"\nmemory_gib = 40\n[framework]\nname = "nanotron"\nlogits_bytes = 12.0\n')
    fw, hw = profile.load(path, None, "h100")
    assert hw.memory_gib == 40 and fw is not None and fw.name == "nanotron" and fw.logits_bytes == 12.0
    out = _plan(["--hardware", str(path), "--model", "llama3-8b", "--global-batch", "1M",
                 "--layout", "dp=8,mbs=1,zero=1"], capsys)
    assert "of 40" in out
    # --framework naming another framework takes that framework's defaults
    fw3, _ = profile.load(path, "fivefold", "h100")
    assert fw3 is not None and fw3.name == "fivefold"


@pytest.mark.parametrize("text, words", [
    ('[framework]\nname = "nanotron"\nlogit_bytes = 1.0\n', ["logit_bytes", "logits_bytes"]),
    ('[framework]\nname = "nano"\n', ["nano", "nanotron"]),
    ('[framework]\nname = "nanotron"\nparam_bytes = 2.5\n', ["param_bytes", "whole"]),
    ('memory_gib = 40\n[hardware]\nmemory_gib = 30\n', ["memory_gib", "both"]),
])
def test_bad_profile_names_the_field(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        profile.load(path, None, "h100")
    for w in words:
        assert w in str(e.value)


def test_job_shares_the_fabric():
    hw = get_cluster("h100-efa")
    nbytes = 64e6
    # a tp16 group spans 2 nodes; in a 2-node job it runs at the 2-node bus bandwidth, in a 64-node job at the
    # 64-node one (all-gather at 0.57 of all-reduce's across nodes), ring latency (n - 1) steps
    for job_nodes in (2, 64):
        h = comm.in_job(hw, job_nodes * 8)
        bw = hw.busbw_gbps[job_nodes] * 1e9 * 0.57
        expect = 15 / 16 * nbytes / bw + 15 * hw.inter_latency_us * 1e-6
        assert comm.all_gather(nbytes, 16, 1, h) == pytest.approx(expect)
    # inside a node nothing changes
    assert comm.all_gather(nbytes, 8, 1, comm.in_job(hw, 512)) == comm.all_gather(nbytes, 8, 1, hw)


def test_all_reduce_latency_is_a_tree_between_nodes():
    hw = get_cluster("h100")  # no measured table: the per-device link bandwidths
    size, stride, nbytes = 256, 8, 1e3  # one rank per node in each of 256 nodes: latency dominates
    expect = 2 * (255 / 256) * nbytes / (hw.inter_node_gbps * 1e9) + 2 * math.ceil(math.log2(256)) \
        * hw.inter_latency_us * 1e-6
    assert comm.all_reduce(nbytes, size, stride, hw) == pytest.approx(expect)
    # inside a node: the ring, 2 (n - 1) steps
    expect_in = 2 * (7 / 8) * nbytes / (hw.intra_node_gbps * 1e9) + 2 * 7 * hw.intra_latency_us * 1e-6
    assert comm.all_reduce(nbytes, 8, 1, hw) == pytest.approx(expect_in)
