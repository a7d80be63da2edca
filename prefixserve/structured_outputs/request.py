"""A request's grammar while it compiles and once it is ready (``StructuredOutputRequest``).

The engine submits the request's ``StructuredOutputsParams`` to the ``StructuredOutputManager``
when the request arrives; the scheduler admits the request only once ``is_ready`` (it waits in the
queue holding no KV blocks, and never stalls the batch), then starts its first sequence's
``Grammar`` with ``new_grammar``. Later sequences (n > 1 samples, beams) fork that grammar.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prefixserve.structured_outputs.grammar import Grammar
from prefixserve.structured_outputs.params import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(
        self,
        params: StructuredOutputsParams,
        compiled: Future[Any],
        new_grammar: Callable[[Any], Grammar],
    ) -> None:
        self.params = params
        self._compiled = compiled
        self._new_grammar = new_grammar

    @property
    def is_ready(self) -> bool:
        """Whether compiling ended (successfully or not)."""
        return self._compiled.done()

    def new_grammar(self) -> Grammar:
        """A grammar at its start; raises the compile's ``InvalidArgumentError`` if it failed.

        Only once ``is_ready``."""
        return self._new_grammar(self._compiled.result(timeout=0))
