"""Which module is the model, in a zero-code script with no DDP model to hook.

DDP marks the model in a distributed script (`runtime/auto.py` hooks its forward). A single
process has no such mark, so for its first step global module hooks watch every top-level
module call (one made while no other module's forward runs). At the first optimizer step,
the top-level module that holds that optimizer's parameters is the model: its own forward
hooks time each step from then on, and the global hooks, which put every module call of the
whole program on PyTorch's slow path, are removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RootForwardFinder:
    def __init__(self, on_start: Callable[[Any], None], on_end: Callable[[], None]) -> None:
        from torch import compiler
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._on_start = on_start
        self._on_end = on_end
        self._depth = 0
        self._seen: list[Any] = []  # top-level modules called so far, first call first
        self._handles = [
            register_module_forward_pre_hook(compiler.disable(self._global_pre)),
            register_module_forward_hook(compiler.disable(self._global_post)),
        ]
        self.root: Any = None

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def _global_pre(self, module: Any, args: Any) -> None:
        if self._depth == 0:
            if all(m is not module for m in self._seen):
                self._seen.append(module)
            self._on_start(args)
        self._depth += 1

    def _global_post(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._on_end()

    def settle(self, optimizer: Any) -> Any:
        """At the first optimizer step: hook the top-level module holding most of
        `optimizer`'s parameters, by element count (None if none holds any: a trainable
        embedding called before the model holds some, the model most), and stop watching
        every module call."""
        seen = self._seen
        self.stop()
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}

        def held(module: Any) -> int:
            return sum(p.numel() for p in module.parameters() if id(p) in owned)

        count, index = max(  # the most held; of equals, the first called
            ((held(m), -i) for i, m in enumerate(seen)), default=(0, 0)
        )
        index = -index
        self.root = seen[index] if count > 0 else None
        if self.root is not None:
            self._hook(self.root)
        return self.root

    def _hook(self, module: Any) -> None:
        from torch import compiler

        start, end = self._on_start, self._on_end
        module.register_forward_pre_hook(
            compiler.disable(lambda m, a, k: start((a, k))), with_kwargs=True
        )
        module.register_forward_hook(compiler.disable(lambda m, a, o: end()))

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._seen = []
