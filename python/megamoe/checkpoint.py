"""Routed-expert weights in the checkpoint format DeepSeek V3-class models ship, to megamoe's natural layout.

Per expert e, under a prefix such as "model.layers.3.mlp.experts.":
    {prefix}{e}.gate_proj.weight            float8_e4m3fn [I, H]
    {prefix}{e}.gate_proj.weight_scale_inv  float32 [I / 128, H / 128]
    {prefix}{e}.up_proj.weight              float8_e4m3fn [I, H]   (+ weight_scale_inv [I / 128, H / 128])
    {prefix}{e}.down_proj.weight            float8_e4m3fn [H, I]   (+ weight_scale_inv [H / 128, I / 128])
with w = w_fp8 * weight_scale_inv[n // 128, k // 128] (DeepSeek's `weight_dequant`): exactly megamoe's per-128x128
weight SF (DESIGN section 4), so the codes and scales are used as they are. The natural layout
(megamoe.weights.transform_weights' input): w1 [E, 2I, H] with the gate rows [0, I) and the up rows [I, 2I),
w1_sf [E, 2I / 128, H / 128], w2 [E, H, I], w2_sf [E, H / 128, I / 128].

`tensors` is any mapping from names to tensors: a dict, or a safetensors file opened with
`safetensors.safe_open(path, "pt")` wrapped by `SafetensorsFiles` (only the local experts' tensors are read).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from megamoe import reference

__all__ = ["PROJECTIONS", "SafetensorsFiles", "expert_tensor_names", "load_deepseek_experts"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_tensor_names(prefix: str, expert_idx: int) -> list[str]:
    """The six tensor names of one expert."""
    return [f"{prefix}{expert_idx}.{proj}.{kind}" for proj in PROJECTIONS for kind in ("weight", "weight_scale_inv")]


class SafetensorsFiles(Mapping):
    """A read-only mapping over the tensors of one or more .safetensors files (a sharded checkpoint): a tensor is
    read from disk when it is looked up."""

    def __init__(self, paths: Iterable[str], device: str = "cpu") -> None:
        from safetensors import safe_open

        self._handles = [safe_open(str(p), framework="pt", device=device) for p in paths]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _get(tensors: Mapping[str, Any], name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"checkpoint has no tensor {name!r}")
    return reference._check_tensor(name, tensors[name], dtype, shape)


def load_deepseek_experts(tensors: Mapping[str, Any], prefix: str, expert_ids: Sequence[int], hidden: int,
                          intermediate: int, *, device: torch.device | str = "cpu"
                          ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((w1, w1_sf), (w2, w2_sf)) in the natural layout for the experts `expert_ids` (global ids, in order: local
    expert j is expert_ids[j]), on `device`. Named errors for a missing tensor or a wrong dtype or shape."""
    h, i = hidden, intermediate
    if h % 128 or i % 128:
        raise ValueError(f"hidden and intermediate must be multiples of 128, got {h} and {i}")
    e = len(expert_ids)
    fp8 = torch.float8_e4m3fn
    w1 = torch.empty(e, 2 * i, h, dtype=fp8, device=device)
    w1_sf = torch.empty(e, 2 * i // 128, h // 128, dtype=torch.float32, device=device)
    w2 = torch.empty(e, h, i, dtype=fp8, device=device)
    w2_sf = torch.empty(e, h // 128, i // 128, dtype=torch.float32, device=device)
    for j, expert_idx in enumerate(expert_ids):
        base = f"{prefix}{expert_idx}."
        for half, proj in enumerate(("gate_proj", "up_proj")):
            w1[j, half * i:(half + 1) * i] = _get(tensors, base + proj + ".weight", fp8, (i, h))
            w1_sf[j, half * i // 128:(half + 1) * i // 128] = _get(tensors, base + proj + ".weight_scale_inv",
                                                                   torch.float32, (i // 128, h // 128))
        w2[j] = _get(tensors, base + "down_proj.weight", fp8, (h, i))
        w2_sf[j] = _get(tensors, base + "down_proj.weight_scale_inv", torch.float32, (h // 128, i // 128))
    return (w1, w1_sf), (w2, w2_sf)
