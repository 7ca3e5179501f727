"""The per-call fast paths skip work only while what it would compute is unchanged: a session's
reused binding, the module's attributes read again only on change, the last signature reused.
And the sessions' thread settings."""

from __future__ import annotations

import math
import threading

import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper

from lazygrad.module_state import ModuleState
from lazygrad.session import FOLDED_AT_MOST, GraphSession
from lazygrad.signature import LastSignature, flatten_call, signature_of


def _affine_session(call_inputs: int = 1) -> GraphSession:
    """y = x_0 * w + b (+ x_1 + ...): w and b are module state, the x_i the call's inputs."""
    names = [f"x{i}" for i in range(call_inputs)]
    nodes = [
        helper.make_node("Mul", ["x0", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["s0"]),
    ]
    for i, name in enumerate(names[1:], start=1):
        nodes.append(helper.make_node("Add", [f"s{i - 1}", name], [f"s{i}"]))
    nodes.append(helper.make_node("Identity", [f"s{call_inputs - 1}"], ["y"]))
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
    graph = helper.make_graph(nodes, "affine", [value(n) for n in ["w", "b", *names]], [value("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return GraphSession(model, torch.device("cpu"), persistent=frozenset({"w", "b"}))


def _expired(tensor_storage_ref: int) -> bool:
    return torch.UntypedStorage._expired(tensor_storage_ref)


@pytest.mark.parametrize("call_inputs", [1, 3])  # fewer / more call inputs than state inputs
def test_a_session_run_keeps_none_of_the_calls_inputs_or_outputs_alive(call_inputs):
    session = _affine_session(call_inputs)
    w, b = torch.randn(4), torch.randn(4)
    xs = [torch.randn(4) for _ in range(call_inputs)]
    (y,) = session.run([w, b, *xs])
    torch.testing.assert_close(y, xs[0] * w + b + sum(xs[1:], torch.zeros(4)))
    refs = [t.untyped_storage()._weak_ref() for t in (*xs, y)]
    del xs, y
    assert all(_expired(ref) for ref in refs)
    (again,) = session.run([w, b, *(torch.ones(4) for _ in range(call_inputs))])
    torch.testing.assert_close(again, w + b + call_inputs - 1)


@pytest.mark.parametrize("call_inputs", [1, 3])  # state kept bound / bound again every call
def test_state_updated_in_place_or_given_new_storage_or_layout_is_seen(call_inputs):
    session = _affine_session(call_inputs)
    w, b, x = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    zeros = [torch.zeros(4, 4)] * (call_inputs - 1)
    check = lambda: torch.testing.assert_close(  # noqa: E731
        session.run([w, b, x, *zeros])[0], x * w + b
    )
    check()
    w.add_(1.0)  # in place, as an optimizer: the bound value aliases it
    check()
    w.data = torch.randn(4, 4)  # new storage, same tensor object
    check()
    storage = torch.randn(32)
    b.data = storage[16:].view(4, 4)  # a view: another data pointer
    check()
    w.data = w.data.t()  # the same data pointer, transposed: bound as a contiguous copy
    check()
    w.add_(1.0)
    check()
    w.data = w.data.t()  # contiguous again, at the pointer bound before the transpose
    w.add_(1.0)
    check()


def test_sessions_use_torchs_thread_count_and_spin_only_within_a_run():
    """ORT's threads spin between a run's kernels but not after it, when torch's threads run
    the loss and the optimizer on the same cores."""
    threads = torch.get_num_threads()
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            options = _affine_session()._session.get_session_options()
            assert options.intra_op_num_threads == count
            assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
            assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    finally:
        torch.set_num_threads(threads)


def test_a_gradients_zeros_are_made_each_run_not_kept_as_a_folded_constant(tmp_path):
    """An embedding's gradient starts as zeros of the table's static shape (ConstantOfShape),
    rows added by a scatter. ORT's constant folding made those zeros an initializer the
    session kept for good (38 MiB for workload A's vocabulary, whose whole-process peak it
    raised); capped, the session makes them each run. The graph ORT runs, written by the same
    session options, holds no constant that large, and the result is right."""
    width = 64
    rows = 2 * FOLDED_AT_MOST // (4 * width)  # float32 zeros of twice the cap
    zeros = helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                             value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    scatter = helper.make_node("ScatterElements", ["zeros", "index", "updates"], ["grad"],
                               reduction="add")
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [rows, width])
    graph = helper.make_graph(
        [zeros, scatter], "embedding_gradient",
        [helper.make_tensor_value_info("index", TensorProto.INT64, [3, width]),
         helper.make_tensor_value_info("updates", TensorProto.FLOAT, [3, width])],
        [helper.make_tensor_value_info("grad", TensorProto.FLOAT, [rows, width])], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = GraphSession(model, torch.device("cpu"))
    index = torch.tensor([[5] * width, [7] * width, [5] * width])
    updates = torch.randn(3, width)
    (grad,) = session.run([index, updates])
    expected = torch.zeros(rows, width).index_add_(0, index[:, 0], updates)
    torch.testing.assert_close(grad, expected)
    options = session._session.get_session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(model.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    sizes = [math.prod(tensor.dims) for tensor in optimized.graph.initializer]
    assert max(sizes, default=0) < rows * width, sizes


def test_threads_run_one_session_at_once_each_on_its_own_binding():
    session = _affine_session()
    w, b = torch.randn(64), torch.randn(64)
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(200):
                x = torch.randn(64, generator=generator)
                torch.testing.assert_close(session.run([w, b, x])[0], x * w + b)
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


class _Flags(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.scale = torch.ones(())  # a tensor attribute: not plain, not part of the modes
        self.first = True

    def forward(self, x):
        if getattr(self, "second", None) or getattr(self, "third", None):  # the flags it reads
            x = -x
        return self.inner(x) * self.scale


def test_modes_are_the_same_object_until_a_plain_attribute_changes():
    module = _Flags()
    state = ModuleState(module)
    modes = state.read()[1]
    assert state.read()[1] is modes
    module.scale = torch.ones(())  # another tensor: a trace baked the old one's values in
    assert state.read()[1] != modes
    modes = state.read()[1]
    assert state.read()[1] is modes
    module.scale.add_(1)  # changed in place: its version counter moved
    assert state.read()[1] != modes
    module.scale = 2.0  # a tensor attribute replaced by a plain value
    assert ("scale", 2.0) in state.read()[1][0]
    modes = state.read()[1]
    module.inner.training = False  # .eval() of one submodule
    assert state.read()[1] != modes
    modes = state.read()[1]
    module.second = module.first  # the flag renamed, its value the very same object
    del module.first
    renamed = state.read()[1]
    assert ("second", True) in renamed[0] and ("first", True) not in renamed[0]
    module.__dict__["third"] = 3  # written past __setattr__
    assert ("third", 3) in state.read()[1][0]
    modes = state.read()[1]
    module.steps_seen = 1  # kept on the module by a loop; no code of the model names it
    assert state.read()[1] is modes


def test_the_last_signature_is_reused_only_while_every_part_of_it_is_unchanged():
    module = torch.nn.Linear(3, 2)
    state = ModuleState(module)
    signatures = LastSignature()

    def sign(*args, **kwargs):
        call = flatten_call(args, kwargs)
        tensors, modes = state.read()
        signature = signatures.of(call, tensors, modes)
        assert signature == signature_of(call, tensors, modes)
        return signature

    x = torch.randn(4, 3)
    first = sign(x)
    assert sign(torch.randn(7, 3)) is first  # another size: the same signature
    changes = {
        "a size 1": lambda: sign(torch.randn(1, 3)),
        "dtype": lambda: sign(x.double()),
        "requires_grad of the input": lambda: sign(x.clone().requires_grad_()),
        "rank": lambda: sign(x[None]),
        "a keyword": lambda: sign(input=x),
    }
    for what, change in changes.items():
        assert change() != first, what
        assert sign(x) == first, what
    with torch.no_grad():
        assert sign(x) != first, "grad mode"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sign(x) != first, "autocast"
    module.weight.requires_grad_(False)
    assert sign(x) != first, "requires_grad of a parameter"
    module.weight.requires_grad_(True)
    module.weight.data = module.weight.data.double()  # the same Parameter object, a new dtype
    assert sign(x) != first, "dtype of a parameter"
    module.weight.data = module.weight.data.float()
    module.eval()
    assert sign(x) != first, "eval"
    module.train()
    assert sign(x) == first


def _experts_session() -> GraphSession:
    """y_g = x_g @ W[g]^T per expert g (W state, [3, 5, 4], read through a Transpose), and a
    stacked result Z = stack(y_g^T): the graph an MoE layer's products make (grouped_mm.py)."""
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[0, 2, 1]),
             helper.make_node("Constant", [], ["zero"],
                              value=helper.make_tensor("zero", TensorProto.INT64, [1], [0]))]
    for g in range(3):
        nodes += [
            helper.make_node("Constant", [], [f"i{g}"], value_int=g),
            helper.make_node("Gather", ["Wt", f"i{g}"], [f"w{g}"], axis=0),
            helper.make_node("Gather", ["x", f"i{g}"], [f"x{g}"], axis=0),
            helper.make_node("MatMul", [f"x{g}", f"w{g}"], [f"y{g}"]),
            helper.make_node("Transpose", [f"y{g}"], [f"t{g}"], perm=[1, 0]),
            helper.make_node("Unsqueeze", [f"t{g}", "zero"], [f"u{g}"]),
        ]
    nodes.append(helper.make_node("Concat", ["u0", "u1", "u2"], ["Z"], axis=0))
    nodes.append(helper.make_node("ReduceSum", ["W"], ["total"], keepdims=0))  # reads the whole
    graph = helper.make_graph(
        nodes, "experts",
        [helper.make_tensor_value_info("W", TensorProto.FLOAT, [3, 5, 4]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 4])],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, [3, 5, 2]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return GraphSession(model, torch.device("cpu"), persistent=frozenset({"W"}))


def test_stacked_state_and_a_stacked_result_are_exchanged_as_slices_and_stay_current():
    """An expert weight's slices are inputs of their own over the parameter's memory, the
    stacked result's blocks outputs written into one tensor: ORT's graph has neither the
    weight's Gathers (a Split copy once optimised) nor the Concat. In-place updates, new
    storage and a non-contiguous layout are seen, as for any state."""
    session = _experts_session()
    ran = onnx.load_from_string(session._model_bytes)
    assert "Concat" not in {node.op_type for node in ran.graph.node}
    assert {node.input[0] for node in ran.graph.node if node.op_type == "Gather"} == {"x"}
    assert [value.name for value in ran.graph.input] == ["W", "x", "W.0", "W.1", "W.2"]
    w, x = torch.randn(3, 5, 4), torch.randn(3, 2, 4)

    def check() -> None:
        z, total = session.run([w, x])
        torch.testing.assert_close(z, torch.stack([(x[g] @ w[g].T).T for g in range(3)]))
        torch.testing.assert_close(total, w.sum())
        assert z.is_contiguous() and z.shape == (3, 5, 2)

    check()
    w.add_(1.0)  # in place, as an optimizer: the bound slices alias it
    check()
    w.data = torch.randn(3, 5, 4)  # new storage
    check()
    w.data = torch.randn(3, 4, 5).transpose(1, 2)  # not contiguous: bound as a copy each call
    check()
    w.data = w.data.contiguous()
    w.add_(1.0)
    check()
