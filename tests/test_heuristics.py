"""Config selection (megamoe.heuristics): BLOCK_M buckets, wave fill target, N-major switch, validation and reports."""
from __future__ import annotations

import inspect

import pytest
from rich.console import Console

from megamoe import heuristics
from megamoe.heuristics import (
    MoeConfig,
    config_detail_table,
    config_table,
    min_wave_l1_tiles_for,
    select_config,
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
    [(0.0, 32), (1.0, 32), (16.0, 32), (24.0, 32), (24.01, 64), (25.0, 64), (64.0, 64), (64.5, 64),
     (64.51, 128), (65.0, 128), (1e6, 128)],
)
def test_buckets_explicit(expected: float, block_m: int) -> None:
    config = select_config(8, 256, 8192, 6, 4096, 2048, expected_tokens_per_expert=expected)
    assert config.block_m == block_m
    assert config.cooperative == (block_m == 128)
    assert config.num_math_warpgroups == (2 if block_m == 128 else 1)
    assert config.expected_tokens_per_expert == expected


def test_buckets_derived_at_thresholds() -> None:
    # expected = T_max * R * topk / E, here T_max * 3 / 4
    assert select_config(1, 4, 32, 3, 256, 128).expected_tokens_per_expert == 24.0
    assert select_config(1, 4, 32, 3, 256, 128).block_m == 32
    assert select_config(1, 4, 33, 3, 256, 128).block_m == 64  # 24.75
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
def test_matrix_configs(case: tuple, num_sms: int) -> None:
    _, ranks, experts, tokens, topk, hidden, inter = case
    config = select_config(ranks, experts, tokens, topk, hidden, inter, num_sms=num_sms)
    assert config.block_m == heuristics.block_m_for(config.expected_tokens_per_expert) and config.num_sms == num_sms
    # Waves are cut on the device from the received counts; the config holds their fill target only.
    assert config.min_wave_l1_tiles == min_wave_l1_tiles_for(num_sms, heuristics.WAVE_FILL)


def test_wave_fill_target() -> None:
    assert min_wave_l1_tiles_for(132, 2) == 264 and min_wave_l1_tiles_for(8, 1) == 8
    assert min_wave_l1_tiles_for(132, 0) == heuristics.ONE_WAVE == 2**32 - 1
    assert min_wave_l1_tiles_for(132) == min_wave_l1_tiles_for(132, heuristics.WAVE_FILL)


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
    assert "megamoe config" in captured.err and "BLOCK_M" in captured.err and "wave L1 tiles" in captured.err
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
        MoeConfig(block_m=48, min_wave_l1_tiles=132, n_major_l2=False, expected_tokens_per_expert=1.0, num_sms=132)
    assert "block_m=128" in repr(config) and "cooperative=True" in repr(config)
    console = Console(record=True, width=200)
    console.print(config_table({"pro": config}))
    console.print(config_table([config]))
    console.print(config_detail_table(config))
    text = console.export_text()
    assert "pro" in text and "wave L1 tiles" in text and "N-major" in text


def test_heuristics_reads_env_only_through_envs() -> None:
    source = inspect.getsource(heuristics)
    assert "os.environ" not in source and "getenv" not in source
