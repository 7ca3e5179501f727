"""Why a capture failed: the runtime turns it into a fallback with this reason."""


class CaptureError(RuntimeError):
    """The call cannot be captured as ONNX graphs that compute what eager computes."""
