"""An ordered registry of named implementations of one operation (attention, grouped GEMM): ``auto`` takes
the first that prefers the inputs, a name (argument, else an environment variable) forces one and is refused
with the reason when it cannot run them; the choice is logged once per backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

AUTO = "auto"


class Named(Protocol):
    @property
    def name(self) -> str: ...


B = TypeVar("B", bound=Named)


class BackendRegistry(Generic[B]):
    """Backends of one ``kind`` in ``auto``'s order; ``fallback`` is ``auto``'s choice when none prefers the
    inputs; ``env_var`` names a backend when the caller does not; ``hint`` says where a user chooses one."""

    def __init__(self, kind: str, env_var: str, fallback: str, hint: str, log: logging.Logger) -> None:
        self.kind, self.env_var, self.fallback, self.hint, self.log = kind, env_var, fallback, hint, log
        self.backends: dict[str, B] = {}
        self.announced: set[str] = set()

    def register(self, backend: B, *, before: str | None = None) -> None:
        """Add (or replace) a backend; ``before`` puts it ahead of that one in ``auto``'s order."""
        if backend.name == AUTO:
            raise ValueError(f"{AUTO!r} is reserved for automatic selection: choose another backend name")
        self.backends.pop(backend.name, None)
        if before is not None and before not in self.backends:
            raise ValueError(f"unknown {self.kind} backend {before!r}: choose one of {sorted(self.backends)}")
        entries = list(self.backends.items())
        position = list(self.backends).index(before) if before is not None else len(entries)
        entries.insert(position, (backend.name, backend))
        self.backends = dict(entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self.backends)

    def select(
        self,
        name: str | None,
        preferred: Callable[[B], bool],
        unsupported: Callable[[B], str | None],
        inputs: str,
    ) -> B:
        """``name`` (else ``$env_var``, else ``auto``) resolved for inputs that ``preferred`` / ``unsupported``
        test and ``inputs`` describes in an error."""
        wanted = name or os.environ.get(self.env_var) or AUTO
        if wanted == AUTO:
            chosen = next((b for b in self.backends.values() if preferred(b)), self.backends[self.fallback])
        else:
            if wanted not in self.backends:
                raise ValueError(
                    f"unknown {self.kind} backend {wanted!r}: choose one of {[AUTO, *self.backends]} "
                    f"({self.hint} or ${self.env_var})"
                )
            chosen = self.backends[wanted]
            reason = unsupported(chosen)
            if reason is not None:
                raise ValueError(
                    f"{self.kind} backend {wanted!r} cannot run {inputs}: {reason}. Choose another (or "
                    f"{AUTO!r}) with {self.hint} or ${self.env_var}"
                )
        # Not while torch.compile traces (a fullgraph compile cannot hold a logging call): an eager call logs.
        if chosen.name not in self.announced and not torch.compiler.is_compiling():
            self.announced.add(chosen.name)
            self.log.info("%s backend: %s (from %s)", self.kind, chosen.name, wanted)
        return chosen
