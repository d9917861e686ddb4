"""The wrappers `runtime/auto.py` puts on `DistributedDataParallel`'s methods beyond its
`__init__`: communication hook registration (a script's own hook, and the error for one that
comes too late) and the shadow backward under `join()`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from trainspec.runtime.auto_containment import contained

if TYPE_CHECKING:
    from trainspec.runtime.auto_instrumentation import AutoInstrumentation


# The script registers its own communication hook on a DDP model whose first forward put
# trainspec's on it (DDP takes one, and said only "can only be called once").
SECOND_HOOK = (
    "trainspec registered its communication hook on this DDP model at its first forward, "
    "and DDP takes one: register the script's own hook before the model's first forward "
    "(trainspec's then stays off that model)"
)


def _comm_hook_registration(auto: AutoInstrumentation, original: Any) -> Any:
    """`DistributedDataParallel.register_comm_hook` (or its built-in variant), telling the
    layer of a script's own hook before it goes on."""

    @functools.wraps(original)
    def register(self: Any, *args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.on_script_comm_hook, self)
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as exc:
            from trainspec.runtime.hook_wiring import hook_of

            if auto._registering or hook_of(self) is None:
                raise
            raise RuntimeError(SECOND_HOOK) from exc

    return register


def _join_shadow_pass(auto: AutoInstrumentation, original: Any) -> Any:
    """`DistributedDataParallel`'s shadow backward under `join()`, telling the layer first
    (`on_shadow_pass`)."""

    @functools.wraps(original)
    def shadow_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
        contained(auto, auto.on_shadow_pass)
        return original(self, *args, **kwargs)

    return shadow_pass
