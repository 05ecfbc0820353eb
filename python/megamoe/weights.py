"""Weight layout of the fused kernel (DESIGN section 4): the L1 gate/up row interleave, the tile layout, and weight
validation.

The transform is a pure permutation of the bytes: w1's rows are interleaved (`l1_interleave_permutation`), then w1
and w2 are stored in the tile layout (`tile_weights`), in which each 128-row x 128-column block of an expert's
[N, K] matrix is 16 KB of consecutive bytes, already in the 128 B swizzle of the kernels' shared-memory stages, so
that the kernels load it with one non-tensor bulk copy (components/gemm/producer.cuh: produce_b_tile).
`inverse_transform_weights(*transform_weights(l1, l2))` gives back the inputs bit for bit.

The layout cannot be told from the bytes, so `transform_weights` records the tensors it returns (by storage, for as
long as the storage lives) and `megamoe.fused` refuses weights it has no record of (`check_transformed`): natural
weights, or w1 with the gate / up rows interleaved by the caller (DeepGEMM's layout), would otherwise give wrong
output with no error. Weights that hold the transform's bytes in other tensors (copied, loaded from a file) are
declared with `mark_transformed`.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from .quant import BLOCK

__all__ = [
    "INTERLEAVE",
    "WeightShapes",
    "check_transformed",
    "inverse_transform_weights",
    "is_transformed",
    "l1_interleave_permutation",
    "mark_transformed",
    "tile_weights",
    "transform_weights",
    "untile_weights",
    "validate_weights",
]

# Gate and up rows alternate in groups of this many rows: [g0..g7, u0..u7, g8..g15, u8..u15, ...].
INTERLEAVE = 8

WeightPair = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class WeightShapes:
    """Sizes read off a validated (l1, l2) weight pair."""

    num_local_experts: int
    hidden: int
    intermediate: int
    device: torch.device


def _check_pair(name: str, pair: object) -> WeightPair:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be a (weight, scale) tuple of two tensors, got {type(pair).__name__}"
                        + (f" of length {len(pair)}" if isinstance(pair, (tuple, list)) else ""))
    for i, t in enumerate(pair):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return pair[0], pair[1]


def _check_tensor(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device,
                  require_contiguous: bool) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of w1), got {t.device}")
    if require_contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def validate_weights(l1_weights: object, l2_weights: object, *, require_contiguous: bool = True,
                     label: str = "") -> WeightShapes:
    """Check (w1, w1_sf), (w2, w2_sf) against DESIGN section 4 and return their sizes.

    w1 float8_e4m3fn [E_local, 2I, H], w1_sf float32 [E_local, 2I/128, H/128], w2 float8_e4m3fn [E_local, H, I],
    w2_sf float32 [E_local, H/128, I/128], all on one device, H % 128 == 0, I % 128 == 0. `label` (e.g. " (rank 1)")
    is appended to argument names in error messages.
    """
    w1, w1_sf = _check_pair(f"l1_weights{label}", l1_weights)
    w2, w2_sf = _check_pair(f"l2_weights{label}", l2_weights)
    if w1.dtype != torch.float8_e4m3fn:
        raise TypeError(f"w1{label} must be torch.float8_e4m3fn, got {w1.dtype}")
    if w1.dim() != 3:
        raise ValueError(f"w1{label} must be 3-D [E_local, 2*intermediate, hidden], got shape {tuple(w1.shape)}")
    num_local_experts, two_i, hidden = w1.shape
    if num_local_experts < 1:
        raise ValueError(f"w1{label} must hold at least one expert, got shape {tuple(w1.shape)}")
    if hidden % BLOCK != 0 or hidden == 0:
        raise ValueError(f"hidden (w1{label}.shape[2]) must be a positive multiple of {BLOCK}, got {hidden}")
    if two_i % (2 * BLOCK) != 0 or two_i == 0:
        raise ValueError(f"2*intermediate (w1{label}.shape[1]) must be a positive multiple of {2 * BLOCK} "
                         f"(intermediate % {BLOCK} == 0), got {two_i}")
    intermediate = two_i // 2
    device = w1.device
    _check_tensor(f"w1{label}", w1, torch.float8_e4m3fn, (num_local_experts, two_i, hidden), device,
                  require_contiguous)
    _check_tensor(f"w1_sf{label}", w1_sf, torch.float32, (num_local_experts, two_i // BLOCK, hidden // BLOCK),
                  device, require_contiguous)
    _check_tensor(f"w2{label}", w2, torch.float8_e4m3fn, (num_local_experts, hidden, intermediate), device,
                  require_contiguous)
    _check_tensor(f"w2_sf{label}", w2_sf, torch.float32, (num_local_experts, hidden // BLOCK, intermediate // BLOCK),
                  device, require_contiguous)
    return WeightShapes(num_local_experts, hidden, intermediate, device)


def l1_interleave_permutation(intermediate: int, device: torch.device | str = "cpu") -> Tensor:
    """int64 [2I]: interleaved row i of w1 is natural row perm[i] (gate rows [0, I), up rows [I, 2I)).

    perm = [0..7, I+0..I+7, 8..15, I+8..I+15, ...].
    """
    if not isinstance(intermediate, int) or intermediate <= 0 or intermediate % INTERLEAVE != 0:
        raise ValueError(f"intermediate must be a positive multiple of {INTERLEAVE}, got {intermediate!r}")
    rows = torch.arange(intermediate, device=device).view(-1, INTERLEAVE)  # [I/8, 8] gate rows per group
    return torch.stack([rows, rows + intermediate], dim=1).flatten()


# The tile layout: blocks of TILE_ROWS rows x TILE_BYTES bytes, 16 B chunks swizzled within each row by the row's
# index mod 8 (the TMA's and WGMMA's 128 B swizzle: chunk c of row r sits at position c ^ (r % 8))
TILE_ROWS = TILE_BYTES = 128
SWIZZLE_CHUNK = 16


def _chunk_order(w: Tensor, row_perm: Tensor | None = None) -> Tensor:
    """int64 [N K / 16]: chunk i of one expert's [N, K] in the tile layout is chunk order[i] of the row-major one
    (16 B chunks, row-major order), after w's rows are permuted by `row_perm` (tile row n is natural row
    row_perm[n]) if given. N and K must be multiples of 128."""
    _, n, k = w.shape
    if n % TILE_ROWS or k % TILE_BYTES:
        raise ValueError(f"the tile layout needs N and K multiples of {TILE_ROWS}, got shape {tuple(w.shape)}")
    chunks = TILE_BYTES // SWIZZLE_CHUNK
    arange = functools.partial(torch.arange, device=w.device)
    # Tile chunk (n block, k block, row r of the block, position p) holds the row's chunk p ^ (r % 8) of that k block
    n_block = arange(n // TILE_ROWS).view(-1, 1, 1, 1)
    k_block = arange(k // TILE_BYTES).view(1, -1, 1, 1)
    r = arange(TILE_ROWS).view(1, 1, -1, 1)
    p = arange(chunks).view(1, 1, 1, -1)
    row = n_block * TILE_ROWS + r
    if row_perm is not None:
        row = row_perm.to(w.device)[row]
    return (row * (k // SWIZZLE_CHUNK) + k_block * chunks + (p ^ (r % 8))).flatten()


def _chunks(w: Tensor) -> Tensor:
    """int64 [E, N K / 16, 2]: w's bytes (contiguous) as 16 B chunks, moved as pairs of 8 B words."""
    return w.contiguous().view(torch.uint8).view(w.shape[0], -1, SWIZZLE_CHUNK).view(torch.int64)


def _to_tiles(w: Tensor, row_perm: Tensor | None = None) -> Tensor:
    """One gather: the output (a new tensor) is all it allocates besides the index (N K / 2 bytes, one expert's
    worth): no intermediate copy of the weights, whose size is what bounds a transform on a full GPU."""
    return _chunks(w).index_select(1, _chunk_order(w, row_perm)).view(w.dtype).view(w.shape)


def _from_tiles(w: Tensor, row_perm: Tensor | None = None) -> Tensor:
    """The inverse of `_to_tiles` (one scatter into a new tensor)."""
    out = torch.empty_like(w, memory_format=torch.contiguous_format)
    _chunks(out).index_copy_(1, _chunk_order(w, row_perm), _chunks(w))
    return out


def tile_weights(w: Tensor) -> Tensor:
    """e4m3 [E, N, K] row-major -> the same shape in the tile layout: for each expert, n block and k block (in that
    order) 16 KB = 128 rows of 128 B, the 16 B chunks of row r in the order c ^ (r % 8). A new tensor."""
    return _to_tiles(w)


def untile_weights(w: Tensor) -> Tensor:
    """The inverse of `tile_weights`: the tile layout -> row-major, same shape. A new tensor."""
    return _from_tiles(w)


# The w1 / w2 tensors in the kernel's layout: (role, data_ptr) -> (shape, weak reference to the storage). An entry
# counts only while its storage lives, so memory freed and reused by other weights is not mistaken for it; tensors
# that share the storage (nn.Parameter(w), w.data, views of the whole tensor) are the same weights.
_TRANSFORMED: dict[tuple[str, int], tuple[tuple[int, ...], weakref.ref]] = {}


def _record(role: str, t: Tensor) -> None:
    for key in [k for k, (_, ref) in _TRANSFORMED.items() if ref() is None]:
        del _TRANSFORMED[key]
    _TRANSFORMED[(role, t.data_ptr())] = (tuple(t.shape), weakref.ref(t.untyped_storage()))


def _recorded(role: str, t: Tensor) -> bool:
    entry = _TRANSFORMED.get((role, t.data_ptr()))
    return entry is not None and entry[0] == tuple(t.shape) and entry[1]() is not None


def mark_transformed(l1_weights: WeightPair, l2_weights: WeightPair) -> None:
    """Declare (w1, w1_sf), (w2, w2_sf) to hold `transform_weights`' output (e.g. copied into parameters or loaded
    from a file written from it), so that `megamoe.fused` accepts them. The bytes are not checked: weights in any
    other layout give wrong output."""
    validate_weights(l1_weights, l2_weights)
    _record("w1", l1_weights[0])
    _record("w2", l2_weights[0])


def is_transformed(l1_weights: WeightPair, l2_weights: WeightPair) -> bool:
    """Whether w1 and w2 are tensors `transform_weights` returned (or `mark_transformed` declared)."""
    return _recorded("w1", l1_weights[0]) and _recorded("w2", l2_weights[0])


def check_transformed(l1_weights: WeightPair, l2_weights: WeightPair) -> None:
    """ValueError naming the weight that is not in the kernel's layout (see the module docstring)."""
    for name, role, t in (("l1_weights[0] (w1)", "w1", l1_weights[0]), ("l2_weights[0] (w2)", "w2", l2_weights[0])):
        if not _recorded(role, t):
            raise ValueError(
                f"{name} is not in the fused kernel's layout: pass the natural weights through "
                f"megamoe.transform_weights (transform_weights_for_mega_moe_sm90 under DeepGEMM's names), which "
                f"interleaves w1's gate / up rows and stores w1 and w2 in the tile layout; w1 with its rows "
                f"interleaved by the caller is not enough. Tensors that hold the transform's output copied or "
                f"loaded from a file: declare them with megamoe.weights.mark_transformed(l1_weights, l2_weights).")


def transform_weights(l1_weights: WeightPair, l2_weights: WeightPair) -> tuple[WeightPair, WeightPair]:
    """Natural weights -> the fused kernel's layout: ((w1_tiled, w1_sf), (w2_tiled, w2_sf)).

    w1's rows are interleaved in groups of 8 (`l1_interleave_permutation`), then w1 and w2 are stored in the tile
    layout (`tile_weights`), each a new contiguous tensor of the original shape. w1_sf and w2_sf are returned as the
    same tensor objects (no copy): scales stay in the natural [E_local, N/128, K/128] layout. The returned w1 and w2
    are recorded as the kernel's layout (`check_transformed`).
    """
    shapes = validate_weights(l1_weights, l2_weights)
    perm = l1_interleave_permutation(shapes.intermediate, device=shapes.device)
    l1 = (_to_tiles(l1_weights[0], perm), l1_weights[1])
    l2 = (_to_tiles(l2_weights[0]), l2_weights[1])
    mark_transformed(l1, l2)
    return l1, l2


def inverse_transform_weights(l1_weights: WeightPair, l2_weights: WeightPair) -> tuple[WeightPair, WeightPair]:
    """The kernel's layout -> natural weights; exact inverse of `transform_weights` (same aliasing rules)."""
    shapes = validate_weights(l1_weights, l2_weights)
    perm = l1_interleave_permutation(shapes.intermediate, device=shapes.device)
    return (_from_tiles(l1_weights[0], perm), l1_weights[1]), (_from_tiles(l2_weights[0]), l2_weights[1])
