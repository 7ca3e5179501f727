"""Why a capture failed: the runtime turns it into a fallback with this reason."""


class CaptureError(RuntimeError):
    """The call cannot be captured as ONNX graphs that compute what eager computes.

    `where`: the qualified name of the innermost submodule whose code failed ("" for the module
    itself, None where unknown), so the runtime can capture around it (`parts.py`).
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where
