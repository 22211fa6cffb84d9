"""`Launch`: a compiled Triton kernel's launch with the host work of ``JITFunction.run`` done once.

After a kernel's first launch for a specialization (`interop.triton_attention.PagedAttention`,
`interop.triton_write`), later launches call the compiled kernel's C launcher directly: no argument binding or
specialization, no ``launch_metadata``, no launch-hook calls. That is tens of microseconds of host time per launch,
paid per layer and decode step by the held-aside steps of `interop.hf.JMixedKVCache`.
"""
from __future__ import annotations

import torch

__all__ = ["Launch"]


class Launch:
    """A compiled Triton kernel's launch with its grid and constexprs fixed: ``launch(args)`` calls the kernel's
    C launcher directly (the current stream of its device; no ``launch_metadata`` and no hook calls) while its
    device is the current one and no launch hook is installed (as a profiler such as proton does); else Triton's
    runner, under its device."""

    __slots__ = ("runner", "run", "grid", "function", "packed", "constants", "device", "stream", "hooks", "current")

    def __init__(self, compiled, grid, constants, device: int):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.runner = compiled[grid]                         # also loads the module (`_init_handles`)
        self.run = getattr(compiled, "_run", None)
        self.function = getattr(compiled, "function", None)
        self.packed = getattr(compiled, "packed_metadata", None)
        self.grid, self.constants, self.device = grid, constants, device
        from triton import knobs
        from triton.runtime.driver import driver
        self.stream, self.hooks = driver.active.get_current_stream, knobs.runtime
        self.current = torch.cuda.current_device

    def __call__(self, args) -> None:
        if self.run is None or self.function is None or self.current() != self.device or self._hooked():
            with torch.cuda.device(self.device):
                self.runner(*args, *self.constants)
            return
        g = self.grid
        self.run(g[0], g[1], g[2], self.stream(self.device), self.function, self.packed, None, None, None, *args,
                 *self.constants)

    def _hooked(self) -> bool:
        """Whether a Triton launch hook is installed (it needs Triton's runner: metadata, enter / exit calls)."""
        rt = self.hooks
        return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)
                    or getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook))
