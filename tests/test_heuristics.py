"""Config selection: BLOCK_M bands, SMEM plan within 232448 B with >= 3 stages, wave size, N-major switch."""
from __future__ import annotations

import inspect
import math
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from megamoe import heuristics
from megamoe.heuristics import (
    SMEM_CAPACITY_BYTES,
    MoeConfig,
    config_detail_table,
    config_table,
    num_experts_per_wave_for,
    select_config,
    smem_plan,
    smem_table,
)
from test_layout import RANKS, TEST_MATRIX

MATRIX_CASES = [
    (name, ranks, experts, tokens, topk, hidden, inter)
    for name, experts, hidden, inter, topk, token_counts in TEST_MATRIX
    for ranks in RANKS
    for tokens in token_counts
]


@pytest.fixture(autouse=True)
def _auto_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEGAMOE_NMAJOR", raising=False)
    monkeypatch.delenv("MEGAMOE_PRINT_CONFIGS", raising=False)


@pytest.mark.parametrize(
    ("expected", "block_m"),
    [(0.0, 32), (1.0, 32), (16.0, 32), (16.5, 32), (16.51, 64), (17.0, 64), (64.0, 64), (64.5, 64),
     (64.51, 128), (65.0, 128), (1e6, 128)],
)
def test_bands_explicit(expected: float, block_m: int) -> None:
    config = select_config(8, 256, 8192, 6, 4096, 2048, expected_tokens_per_expert=expected)
    assert config.block_m == block_m
    assert config.cooperative == (block_m == 128)
    assert config.num_math_warpgroups == (2 if block_m == 128 else 1)
    assert config.expected_tokens_per_expert == expected


def test_bands_derived_at_thresholds() -> None:
    # expected = T_max * R * topk / E, here T_max * 3 / 4
    assert select_config(1, 4, 22, 3, 256, 128).expected_tokens_per_expert == 16.5
    assert select_config(1, 4, 22, 3, 256, 128).block_m == 32
    assert select_config(1, 4, 23, 3, 256, 128).block_m == 64  # 17.25
    assert select_config(1, 4, 86, 3, 256, 128).expected_tokens_per_expert == 64.5
    assert select_config(1, 4, 86, 3, 256, 128).block_m == 64
    assert select_config(1, 4, 87, 3, 256, 128).block_m == 128  # 65.25
    assert select_config(2, 8, 43, 3, 256, 128).block_m == 64  # 43 * 2 * 3 / 8 = 32.25: ranks count


def test_config_never_takes_local_tokens() -> None:
    parameters = inspect.signature(select_config).parameters
    assert not any("num_tokens" == name or name == "num_local_tokens" for name in parameters)
    # Same shared values -> same config, whatever any rank's local T is (T is not an input).
    configs = {select_config(8, 384, 4096, 6, 7168, 3072) for _ in range(3)}
    assert len(configs) == 1


@pytest.mark.parametrize("case", MATRIX_CASES, ids=[f"{c[0]}-r{c[1]}-t{c[3]}" for c in MATRIX_CASES])
@pytest.mark.parametrize("num_sms", [132, 78])
def test_matrix_fits_smem(case: tuple, num_sms: int) -> None:
    _, ranks, experts, tokens, topk, hidden, inter = case
    config = select_config(ranks, experts, tokens, topk, hidden, inter, num_sms=num_sms)
    plan = config.smem_plan
    assert 3 <= config.num_stages <= 8
    assert config.smem_bytes == plan.total_bytes <= SMEM_CAPACITY_BYTES
    assert plan.total_bytes == plan.fixed_bytes + config.num_stages * plan.stage_bytes
    # One more stage would not fit (unless capped at 8).
    assert config.num_stages == 8 or plan.total_bytes + plan.stage_bytes > SMEM_CAPACITY_BYTES
    # Regions back to back; A/B stages 1024 B aligned for the 128 B swizzle.
    offset = 0
    for region in plan.regions:
        assert region.offset == offset
        offset = region.end
    a, b = plan.region("a_stages"), plan.region("b_stages")
    a_stage = a.num_bytes // config.num_stages
    assert a_stage == max(config.block_m, 64) * 128
    for stage in range(config.num_stages):
        assert (a.offset + stage * a_stage) % 1024 == 0
        assert (b.offset + stage * 128 * 128) % 1024 == 0
    assert plan.region("cd").offset % 1024 == 0
    assert plan.region("sfa_stages").offset % 128 == 0
    assert plan.region("combine").offset % 16 == 0
    assert plan.region("barriers").offset % 8 == 0
    assert plan.region("sfa_stages").num_bytes == config.num_stages * max(128, 2 * config.block_m * 4)
    assert plan.region("cd").num_bytes >= max(2 * config.block_m * 64, config.block_m * 128 * 2)
    assert plan.region("dispatch_pull").num_bytes >= 2 * hidden
    assert (2 * hidden) % plan.combine_chunk_bytes == 0
    # Wave size: smallest divisor of E_local that fills the SMs.
    e_local = experts // ranks
    d = config.num_experts_per_wave
    assert e_local % d == 0
    blocks = math.ceil(config.expected_tokens_per_expert / config.block_m) * (2 * inter // 128)
    assert d * blocks >= num_sms or d == e_local
    assert all(not (e_local % s == 0 and s * blocks >= num_sms) for s in range(1, d))


def test_experts_per_wave_examples() -> None:
    assert num_experts_per_wave_for(48, 2.0, 32, 3072, 132) == 3  # 48 L1 blocks per expert
    assert num_experts_per_wave_for(48, 8192.0, 128, 3072, 132) == 1
    assert num_experts_per_wave_for(1, 1.0, 32, 128, 132) == 1  # none suffices -> E_local
    assert num_experts_per_wave_for(7, 1.0, 32, 128, 132) == 7
    assert num_experts_per_wave_for(4, 0.0, 32, 2048, 132) == 4


def test_too_little_smem_raises() -> None:
    with pytest.raises(ValueError, match="stages"):
        smem_plan(128, 128 * 512, 8)


def test_n_major_threshold_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    args = (8, 256, 8192, 6, 4096, 2048)
    assert not select_config(*args, expected_tokens_per_expert=255.9).n_major_l2
    assert select_config(*args, expected_tokens_per_expert=256).n_major_l2
    monkeypatch.setenv("MEGAMOE_NMAJOR", "0")
    assert not select_config(*args, expected_tokens_per_expert=4096).n_major_l2
    monkeypatch.setenv("MEGAMOE_NMAJOR", "1")
    assert select_config(*args, expected_tokens_per_expert=1).n_major_l2
    monkeypatch.setenv("MEGAMOE_NMAJOR", "-1")
    assert not select_config(*args, expected_tokens_per_expert=1).n_major_l2
    monkeypatch.setenv("MEGAMOE_NMAJOR", "2")
    with pytest.raises(ValueError, match="MEGAMOE_NMAJOR"):
        select_config(*args)


def test_print_configs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    select_config(2, 8, 3, 6, 4096, 2048)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MEGAMOE_PRINT_CONFIGS", "1")
    select_config(2, 8, 3, 6, 4096, 2048, num_sms=77)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "megamoe config" in captured.err and "BLOCK_M" in captured.err and "experts/wave" in captured.err
    select_config(2, 8, 3, 6, 4096, 2048, num_sms=77)  # printed once per shape and config
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(hidden=100), "hidden"),
        (dict(num_experts=7), "num_experts"),
        (dict(num_sms=0), "num_sms"),
        (dict(expected_tokens_per_expert=-1.0), "expected_tokens_per_expert"),
        (dict(expected_tokens_per_expert=float("nan")), "expected_tokens_per_expert"),
    ],
)
def test_validation(kwargs: dict, argument: str) -> None:
    args = dict(num_ranks=2, num_experts=8, num_max_tokens_per_rank=4, num_topk=6, hidden=4096, intermediate=2048)
    args.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        select_config(**args)


def test_config_is_frozen_and_reports() -> None:
    config = select_config(8, 384, 8192, 6, 7168, 3072)
    with pytest.raises(AttributeError):
        config.block_m = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="block_m"):
        MoeConfig(block_m=48, num_stages=4, smem_bytes=0, num_experts_per_wave=1, n_major_l2=False,
                  expected_tokens_per_expert=1.0, num_sms=132, smem_plan=config.smem_plan)
    assert "block_m=128" in repr(config) and "cooperative=True" in repr(config)
    console = Console(record=True, width=200)
    console.print(config_table({"pro": config}))
    console.print(config_table([config]))
    console.print(smem_table(config))
    console.print(config_detail_table(config))
    text = console.export_text()
    assert "pro" in text and "a_stages" in text and "N-major" in text


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_config_cpp_compiles(tmp_path: Path) -> None:
    for idx, block_m_expected in enumerate((1.0, 32.0, 1024.0)):
        config = select_config(8, 384, 8192, 6, 7168, 3072, expected_tokens_per_expert=block_m_expected)
        (tmp_path / f"config_{idx}.cuh").write_text(config.to_cpp(namespace=f"megamoe::config{idx}"))
    source = tmp_path / "check.cpp"
    source.write_text("".join(f'#include "config_{i}.cuh"\n' for i in range(3)) + "int main() { return 0; }\n")
    result = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", str(source)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_heuristics_reads_env_only_through_envs() -> None:
    source = inspect.getsource(heuristics)
    assert "os.environ" not in source and "getenv" not in source
