"""Devices: what this build and machine have (``devices()``) and opening one by name.

A device name is ``"cpu"`` or ``KIND:INDEX`` (``"vulkan:0"``; ``"vulkan"`` means index 0). A
non-CPU device holds the weights (uploaded once), the KV cache and recurrent state, and runs
every node it has a kernel for; the rest of a plan runs on the CPU with explicit copies.
"""
from __future__ import annotations

from pyfast._loader import native

__all__ = ["devices", "open_device", "device_name"]


def devices() -> list[dict]:
    """Every device: the CPU first, then each Vulkan (or other compiled-in) device, as dicts with
    ``name``, ``kind``, ``index``, ``description``, ``memory_bytes`` and ``max_buffer_range``. A
    backend kind that has no devices is listed in ``native.backends()`` with the reason."""
    return list(native.devices())


def open_device(device: "str | object | None"):
    """The native Device for a name (None for the CPU). A Device passes through. Raises
    ValueError naming the device when it does not exist (unknown kind, index past the last
    device, or a backend this build lacks) and RuntimeError when its driver fails to open it."""
    if device is None:
        return None
    if isinstance(device, native.Device):
        return device
    if not isinstance(device, str):
        raise ValueError(f"device must be a name such as 'cpu' or 'vulkan:0', got {type(device).__name__}")
    name = device.strip().lower()
    return native.open_device(name)


def device_name(device) -> str:
    """'cpu' or the device's name."""
    return "cpu" if device is None else device.name
