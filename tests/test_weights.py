"""cpu tier: the weight transform is a pure permutation with the layout of DESIGN section 4 (gpu tier: the same bytes
when it runs on the GPU)."""
from __future__ import annotations

import random

import pytest
import torch

from megamoe.weights import (
    inverse_transform_weights,
    l1_interleave_permutation,
    tile_weights,
    transform_weights,
    untile_weights,
    validate_weights,
)

FP8 = torch.float8_e4m3fn


def random_bytes_fp8(*shape: int, seed: int) -> torch.Tensor:
    """Every byte pattern (NaN codes included): a bitwise comparison then checks a pure permutation of bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(FP8)


def make_weights(e: int = 3, hidden: int = 256, inter: int = 384) -> tuple[tuple, tuple]:
    g = torch.Generator().manual_seed(0)
    w1 = random_bytes_fp8(e, 2 * inter, hidden, seed=1)
    w2 = random_bytes_fp8(e, hidden, inter, seed=2)
    w1_sf = torch.rand(e, 2 * inter // 128, hidden // 128, generator=g)
    w2_sf = torch.rand(e, hidden // 128, inter // 128, generator=g)
    return (w1, w1_sf), (w2, w2_sf)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_permutation_is_a_bijection_with_the_design_layout() -> None:
    inter = 384
    perm = l1_interleave_permutation(inter)
    assert perm.dtype == torch.int64 and perm.shape == (2 * inter,)
    assert torch.equal(torch.sort(perm).values, torch.arange(2 * inter))
    assert perm[:8].tolist() == list(range(8))                      # g0..g7
    assert perm[8:16].tolist() == list(range(inter, inter + 8))     # u0..u7
    assert perm[16:24].tolist() == list(range(8, 16))               # g8..g15
    assert perm[24:32].tolist() == list(range(inter + 8, inter + 16))
    assert perm[-8:].tolist() == list(range(2 * inter - 8, 2 * inter))
    # An interleaved 128-row tile m holds gate rows [64m, 64m+64) and up rows [I+64m, I+64m+64).
    for m in range(2 * inter // 128):
        rows = set(perm[128 * m:128 * (m + 1)].tolist())
        assert rows == set(range(64 * m, 64 * m + 64)) | set(range(inter + 64 * m, inter + 64 * m + 64))


def test_transform_moves_rows_and_keeps_the_rest() -> None:
    l1, l2 = make_weights()
    (w1, w1_sf), (w2, w2_sf) = l1, l2
    inter = w1.shape[1] // 2
    (t1, t1_sf), (t2, t2_sf) = transform_weights(l1, l2)
    assert t1.dtype == FP8 and t1.shape == w1.shape and t1.is_contiguous()
    assert t2.dtype == FP8 and t2.shape == w2.shape and t2.is_contiguous()
    assert t1.data_ptr() != w1.data_ptr() and t2.data_ptr() != w2.data_ptr()
    r1 = untile_weights(t1)
    assert same_bytes(r1[:, 0:8], w1[:, 0:8])
    assert same_bytes(r1[:, 8:16], w1[:, inter:inter + 8])       # interleaved rows 8..15 = up rows 0..7
    assert same_bytes(r1[:, 16:24], w1[:, 8:16])
    assert same_bytes(r1[:, 2 * inter - 8:], w1[:, 2 * inter - 8:])
    # Scales are the same tensors (documented: no copy); w1 interleaved then tiled, w2 tiled.
    assert t1_sf is w1_sf and t2_sf is w2_sf
    assert same_bytes(t1, tile_weights(w1[:, l1_interleave_permutation(inter)]))
    assert same_bytes(t2, tile_weights(w2))


def test_tile_layout() -> None:
    """Byte (e, n, k) of a row-major [E, N, K] sits at ((e * N/128 + n // 128) * K/128 + k // 128) * 16 KB +
    (n % 128) * 128 + ((k % 128 // 16) ^ (n % 8)) * 16 + k % 16 in the tile layout (the 128 B swizzle of a
    128 x 128 B shared-memory block); untile_weights inverts it."""
    rng = random.Random(3)
    w = torch.randint(0, 256, (2, 256, 384), dtype=torch.uint8).view(FP8)
    tiled = tile_weights(w).view(torch.uint8).flatten()
    natural = w.view(torch.uint8)
    e_, n_, k_ = w.shape
    for _ in range(4000):
        e, n, k = rng.randrange(e_), rng.randrange(n_), rng.randrange(k_)
        offset = ((e * (n_ // 128) + n // 128) * (k_ // 128) + k // 128) * 16384 + (n % 128) * 128 + \
            ((k % 128 // 16) ^ (n % 8)) * 16 + k % 16
        assert tiled[offset] == natural[e, n, k], (e, n, k)
    assert same_bytes(untile_weights(tile_weights(w)), w)
    with pytest.raises(ValueError, match="multiples of 128"):
        tile_weights(w[:, :, :200].contiguous())


def test_inverse_restores_bitwise() -> None:
    l1, l2 = make_weights(e=2, hidden=384, inter=256)
    t1, t2 = transform_weights(l1, l2)
    (b1, b1_sf), (b2, b2_sf) = inverse_transform_weights(t1, t2)
    assert same_bytes(b1, l1[0]) and b1_sf is l1[1]
    assert same_bytes(b2, l2[0]) and b2_sf is l2[1]
    # And the other way round: transform(inverse(w)) == w.
    i1, i2 = inverse_transform_weights(l1, l2)
    assert same_bytes(transform_weights(i1, i2)[0][0], l1[0])
    assert same_bytes(transform_weights(i1, i2)[1][0], l2[0])
    assert not same_bytes(t1[0], l1[0]) and not same_bytes(t2[0], l2[0])  # the transform does move bytes


def test_validate_weights_returns_shapes() -> None:
    l1, l2 = make_weights(e=3, hidden=256, inter=384)
    shapes = validate_weights(l1, l2)
    assert (shapes.num_local_experts, shapes.hidden, shapes.intermediate) == (3, 256, 384)
    assert shapes.device == torch.device("cpu")


def _replace(pair: tuple, index: int, value: torch.Tensor) -> tuple:
    items = list(pair)
    items[index] = value
    return tuple(items)


@pytest.mark.parametrize(
    ("which", "index", "make", "error", "match"),
    [
        ("l1", 0, lambda t: t.float(), TypeError, r"w1 must be torch.float8_e4m3fn, got torch.float32"),
        ("l1", 1, lambda t: t.double(), TypeError, r"w1_sf must be torch.float32"),
        ("l2", 0, lambda t: t.float(), TypeError, r"w2 must be torch.float8_e4m3fn"),
        ("l2", 1, lambda t: t.half(), TypeError, r"w2_sf must be torch.float32"),
        ("l1", 1, lambda t: t[:, :-1], ValueError, r"w1_sf must have shape \(3, 6, 2\), got \(3, 5, 2\)"),
        ("l2", 0, lambda t: t[:2], ValueError, r"w2 must have shape \(3, 256, 384\)"),
        ("l2", 1, lambda t: t[:, :, :1], ValueError, r"w2_sf must have shape"),
        ("l1", 0, lambda t: t[0], ValueError, r"w1 must be 3-D"),
        ("l1", 0, lambda t: t[:, :, :200], ValueError, r"hidden .*multiple of 128, got 200"),
        ("l1", 0, lambda t: t[:, :640], ValueError, r"2\*intermediate .*multiple of 256.*got 640"),
        ("l1", 0, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), ValueError, r"w1 must be contiguous"),
        ("l2", 1, lambda t: torch.empty_like(t, device="meta"), ValueError, r"w2_sf must be on cpu"),
    ],
)
def test_transform_validation(which: str, index: int, make, error: type, match: str) -> None:
    l1, l2 = make_weights(e=3, hidden=256, inter=384)
    if which == "l1":
        l1 = _replace(l1, index, make(l1[index]))
    else:
        l2 = _replace(l2, index, make(l2[index]))
    with pytest.raises(error, match=match):
        transform_weights(l1, l2)


def test_transform_rejects_non_pairs() -> None:
    l1, l2 = make_weights()
    with pytest.raises(TypeError, match="l1_weights must be a \\(weight, scale\\) tuple"):
        transform_weights(l1[0], l2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"l2_weights\[1\] must be a torch.Tensor"):
        transform_weights(l1, (l2[0], None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="intermediate must be a positive multiple of 8"):
        l1_interleave_permutation(100)


@pytest.mark.gpu
def test_transform_on_the_gpu_gives_the_same_bytes() -> None:
    """The transform runs where the weights are (a serving framework transforms on the GPU): the same bytes as on
    the CPU, both ways."""
    l1, l2 = make_weights(e=3, hidden=512, inter=384)
    cuda = tuple(tuple(t.cuda() for t in pair) for pair in (l1, l2))
    (t1, _), (t2, _) = transform_weights(l1, l2)
    (g1, _), (g2, _) = transform_weights(*cuda)
    assert same_bytes(g1.cpu(), t1) and same_bytes(g2.cpu(), t2)
    (b1, _), (b2, _) = inverse_transform_weights((g1, cuda[0][1]), (g2, cuda[1][1]))
    assert same_bytes(b1.cpu(), l1[0]) and same_bytes(b2.cpu(), l2[0])
