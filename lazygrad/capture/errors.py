"""Why a capture failed: the runtime turns it into a fallback with this reason."""


class CaptureError(RuntimeError):
    """The call cannot be captured as ONNX graphs that compute what eager computes.

    `where`: the qualified name of the innermost submodule whose code failed ("" for the module
    itself, None where unknown), so the runtime can capture around it (`parts.py`).
    `sizes`: the trace failed with sizes as symbols: one for the call's exact sizes may succeed
    (a size made a tensor's value, as DeBERTa's attention span, is data to a trace with
    symbols; a size used as a dict key).
    `lines`: the lines of code whose lengths or integers read from data the trace made as
    each call's data says and could not go on with (`data_lengths.py`): a trace with the first
    call's there may succeed.
    `blamed`: the failure is `where`'s own code's, so every submodule of its class and settings
    would fail alike. Not so of a branch on a size read from data, which a module around it
    may have read (Qwen2.5-VL's vision attention splits by lengths its parent read): traced on
    its own, the size is its input's, and it may capture.
    """

    def __init__(self, message: str, where: str | None = None, sizes: bool = False,
                 lines: frozenset[tuple[str, int]] = frozenset(), blamed: bool = True) -> None:
        super().__init__(message)
        self.where = where
        self.sizes = sizes
        self.lines = lines
        self.blamed = blamed
