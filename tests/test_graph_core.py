"""Structural checks of the core Graph type: a malformed graph is rejected with the culprit named."""

import pytest

from slackswap.errors import SlackSwapError
from slackswap.graph import Graph, Op, OpClass, Phase, Tensor


def _op(name, phase, inputs=(), outputs=()):
    return Op(
        name=name,
        phase=phase,
        op_class=OpClass.ELEMENTWISE,
        layer=0,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        flops=0.0,
        moved_bytes=0,
        duration_s=1e-3,
    )


def _two_op_graph(consumer_first=False):
    ops = [_op("f", Phase.FORWARD, outputs=["x"]), _op("b", Phase.BACKWARD, inputs=["x"])]
    if consumer_first:
        ops.reverse()
    tensors = {"x": Tensor("x", 8, "f", ("b",), 0, saved=True)}
    return Graph(name="g", ops=tuple(ops), tensors=tensors, num_layers=1)


def test_valid_graph_exposes_saved_tensors_and_phases():
    graph = _two_op_graph()
    assert [t.name for t in graph.saved_tensors] == ["x"]
    assert [op.name for op in graph.forward_ops] == ["f"]
    assert [op.name for op in graph.backward_ops] == ["b"]
    assert graph.op_index["b"] == 1


def test_consumer_before_producer_is_rejected_naming_the_tensor():
    with pytest.raises(SlackSwapError, match="'x' is read by 'b' before its producer 'f'"):
        _two_op_graph(consumer_first=True)


def test_unknown_tensor_read_is_rejected():
    ops = (_op("f", Phase.FORWARD, inputs=["ghost"]),)
    with pytest.raises(SlackSwapError, match="reads unknown tensor 'ghost'"):
        Graph(name="g", ops=ops, tensors={}, num_layers=1)


def test_duplicate_op_name_is_rejected():
    ops = (_op("f", Phase.FORWARD), _op("f", Phase.FORWARD))
    with pytest.raises(SlackSwapError, match="duplicate op name 'f'"):
        Graph(name="g", ops=ops, tensors={}, num_layers=1)


def test_graph_is_immutable():
    graph = _two_op_graph()
    with pytest.raises(TypeError):
        graph.tensors["y"] = graph.tensors["x"]  # type: ignore[index]
