"""Host side through the CUDA driver API (cuda-bindings): load a cubin, launch it (cooperative, one CTA per SM),
build TMA descriptors. No C++ extension to build: see the README for why."""
from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megamoe.jit.compiler import CompileResult

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - cpu-only environments without cuda-bindings
    cu = None


def _require_driver() -> Any:
    if cu is None:
        raise RuntimeError("cuda-bindings is not installed: `pip install cuda-bindings` (needed to launch kernels)")
    return cu


def check(result: Any) -> Any:
    """Unpack a cuda-bindings (err, *values) tuple, raising on error with the driver's name for it."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {name.decode() if name else err}: {text.decode() if text else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def ensure_context(device: torch.device) -> None:
    """Make torch's (primary) context current on this thread for the driver API calls that follow."""
    _require_driver()
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.current_stream()  # forces the runtime to make its primary context current
        ctx = check(cu.cuCtxGetCurrent())
        if int(ctx) == 0:
            dev = check(cu.cuDeviceGet(device.index if device.index is not None else torch.cuda.current_device()))
            check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(dev))))


# ---------------------------------------------------------------------------------------------------------
# Kernel arguments: each is a ctypes object whose address goes into the void** array of cuLaunchKernelEx.
# ---------------------------------------------------------------------------------------------------------
def u32(value: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(value)


def i32(value: int) -> ctypes.c_int32:
    return ctypes.c_int32(value)


def u64(value: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(value)


def f32(value: float) -> ctypes.c_float:
    return ctypes.c_float(value)


def ptr(tensor: torch.Tensor | None) -> ctypes.c_uint64:
    return ctypes.c_uint64(0 if tensor is None else tensor.data_ptr())


class TensorMap:
    """A CUtensorMap (128 B, passed as a __grid_constant__ parameter) for a 2D row-major tensor."""

    _DTYPES = {
        torch.float32: "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
        torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
        torch.uint8: "CU_TENSOR_MAP_DATA_TYPE_UINT8",
        torch.float8_e4m3fn: "CU_TENSOR_MAP_DATA_TYPE_UINT8",
        torch.int32: "CU_TENSOR_MAP_DATA_TYPE_INT32",
    }
    _SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B",
                64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}

    def __init__(self, tensor: torch.Tensor, box_rows: int, box_cols: int, swizzle_bytes: int = 0,
                 num_rows: int | None = None, num_cols: int | None = None) -> None:
        _require_driver()
        if tensor.dim() != 2 or tensor.stride(1) != 1:
            raise ValueError(f"TensorMap: need a 2D tensor with unit inner stride, got shape {tuple(tensor.shape)} "
                             f"strides {tensor.stride()}")
        if tensor.dtype not in self._DTYPES:
            raise TypeError(f"TensorMap: unsupported dtype {tensor.dtype}")
        elem = tensor.element_size()
        row_bytes = tensor.stride(0) * elem
        if tensor.data_ptr() % 16 or row_bytes % 16:
            raise ValueError(f"TensorMap: base address and row pitch must be multiples of 16 B "
                             f"(base {tensor.data_ptr():#x}, pitch {row_bytes} B)")
        if swizzle_bytes and box_cols * elem > swizzle_bytes:
            raise ValueError(f"TensorMap: box inner extent {box_cols * elem} B exceeds the {swizzle_bytes} B swizzle")
        if (box_cols * elem) % 16:
            raise ValueError(f"TensorMap: box inner extent {box_cols * elem} B is not a multiple of 16 B")
        self.tensor = tensor  # keep the memory alive as long as the descriptor
        rows = tensor.shape[0] if num_rows is None else num_rows
        cols = tensor.shape[1] if num_cols is None else num_cols
        self.map = check(cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, self._DTYPES[tensor.dtype]), cu.cuuint32_t(2), tensor.data_ptr(),
            [cu.cuuint64_t(cols), cu.cuuint64_t(rows)], [cu.cuuint64_t(row_bytes)],
            [cu.cuuint32_t(box_cols), cu.cuuint32_t(box_rows)], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(cu.CUtensorMapSwizzle, self._SWIZZLE[swizzle_bytes]),
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ))

    @property
    def address(self) -> int:
        return int(self.map.getPtr())


@dataclass
class LaunchedModule:
    module: Any
    function: Any
    dynamic_smem_bytes: int = -1


@dataclass
class Kernel:
    """A compiled kernel, loaded lazily per device; launched with cuLaunchKernelEx."""

    compiled: CompileResult
    num_threads: int
    cooperative: bool = True
    cluster_size: int = 1  # CTAs per cluster along x (> 1: launched non-cooperatively)
    _loaded: dict[int, LaunchedModule] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _max_active_clusters: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def load(self, device: torch.device, dynamic_smem_bytes: int) -> None:
        """Load the module on `device` and allow `dynamic_smem_bytes` now, so that a later launch does no driver
        work first (concurrent cooperative launches: megamoe.testing.virtual_ranks)."""
        self._function(device.index if device.index is not None else torch.cuda.current_device(), dynamic_smem_bytes)

    def _function(self, device_index: int, dynamic_smem_bytes: int) -> Any:
        with self._lock:
            loaded = self._loaded.get(device_index)
            if loaded is None:
                ensure_context(torch.device("cuda", device_index))
                module = check(cu.cuModuleLoadData(self.compiled.cubin()))
                function = check(cu.cuModuleGetFunction(module, self.compiled.name.encode()))
                loaded = self._loaded[device_index] = LaunchedModule(module, function)
            if loaded.dynamic_smem_bytes < dynamic_smem_bytes:
                check(cu.cuFuncSetAttribute(
                    loaded.function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dynamic_smem_bytes))
                loaded.dynamic_smem_bytes = dynamic_smem_bytes
            return loaded.function

    def _launch_config(self, num_blocks: int, dynamic_smem_bytes: int, stream: Any) -> Any:
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = num_blocks, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = self.num_threads, 1, 1
        config.sharedMemBytes = dynamic_smem_bytes
        config.hStream = stream
        attrs = []
        if self.cooperative:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            attrs.append(attr)
        if self.cluster_size > 1:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = self.cluster_size, 1, 1
            attrs.append(attr)
        config.attrs = attrs
        config.numAttrs = len(attrs)
        return config

    def max_active_clusters(self, device: torch.device, dynamic_smem_bytes: int) -> int:
        """How many clusters of `cluster_size` CTAs can be resident at once (some SMs may be left out where a GPC's
        free SMs do not divide into clusters): a persistent kernel's grid must not exceed it."""
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        key = (device_index, dynamic_smem_bytes)
        if key not in self._max_active_clusters:
            function = self._function(device_index, dynamic_smem_bytes)
            config = self._launch_config(self.cluster_size, dynamic_smem_bytes, cu.CUstream(0))
            with torch.cuda.device(device_index):
                self._max_active_clusters[key] = check(cu.cuOccupancyMaxActiveClusters(function, config))
        return self._max_active_clusters[key]

    def launch(self, num_blocks: int, args: Sequence[Any], dynamic_smem_bytes: int,
               device: torch.device | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Launch on `stream` (default: torch's current stream of `device`). `args` are ctypes objects
        (u32/u64/ptr/...), TensorMap, or ctypes Structures, in the kernel's parameter order."""
        device = device or torch.device("cuda", torch.cuda.current_device())
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        function = self._function(device_index, dynamic_smem_bytes)
        stream = stream or torch.cuda.current_stream(device_index)
        addresses = [a.address if isinstance(a, TensorMap) else ctypes.addressof(a) for a in args]
        params = (ctypes.c_void_p * len(addresses))(*addresses)
        config = self._launch_config(num_blocks, dynamic_smem_bytes, cu.CUstream(stream.cuda_stream))
        with torch.cuda.device(device_index):
            check(cu.cuLaunchKernelEx(config, function, ctypes.addressof(params), 0))


_loaded_kernels: dict[tuple[str, int, bool, int], Kernel] = {}


def load(compiled: CompileResult, num_threads: int, cooperative: bool = True, cluster_size: int = 1) -> Kernel:
    """The Kernel of a compiled cubin, one per (cubin, launch shape) for the process: its module is loaded once
    per device, on first launch."""
    key = (compiled.key, num_threads, cooperative, cluster_size)
    kernel = _loaded_kernels.get(key)
    if kernel is None:
        kernel = _loaded_kernels[key] = Kernel(compiled, num_threads, cooperative, cluster_size)
    return kernel


@functools.lru_cache(maxsize=None)
def kernel_for(compile_fn: Callable[[Any], CompileResult], config: Any, num_threads: int,
               cooperative: bool = True, cluster_size: int = 1) -> Kernel:
    """The Kernel of `compile_fn(config)` (a frozen, hashable config), compiled or found in the cache once per
    process: launchers call this on every launch, so the source hashing and cache lookup stay off that path."""
    return load(compile_fn(config), num_threads, cooperative, cluster_size)


def num_sms(device: torch.device | None = None) -> int:
    return torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count
