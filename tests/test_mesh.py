import jax
import pytest
from jax.sharding import AxisType

import zjax


@pytest.mark.parametrize(
    ("kw", "shape"),
    [
        ({}, (1, 1, 8, 1, 1, 1)),
        ({"dp": -1, "tp": 2}, (1, 1, 4, 1, 1, 2)),
        ({"dp": 2, "tp": -1}, (1, 1, 2, 1, 1, 4)),
        ({"dp": 8}, (1, 1, 8, 1, 1, 1)),
        ({"dp": 2, "cp": 4}, (1, 1, 2, 1, 4, 1)),
        ({"dp": 2, "ep": 4}, (1, 1, 2, 4, 1, 1)),
        ({"dp": 2, "ep": -1, "tp": 2}, (1, 1, 2, 2, 1, 2)),
        ({"dp": (2, 4)}, (1, 2, 4, 1, 1, 1)),
        ({"dp": (-1, 2), "tp": 2}, (1, 2, 2, 1, 1, 2)),
    ],
)
def test_sizes_and_inference(kw, shape):
    mesh = zjax.make_mesh(**kw)
    assert mesh.axis_names == ("pp", "replica", "dp", "ep", "cp", "tp")
    assert tuple(mesh.devices.shape) == shape
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_tp_is_innermost():
    mesh = zjax.make_mesh(dp=4, tp=2)
    # the two devices of a tp group are neighbours in jax.make_mesh's order
    row = mesh.devices[0, 0, 0, 0, 0]
    assert {d.id for d in row} == {jax.devices()[0].id, jax.devices()[1].id}


def test_product_mismatch():
    with pytest.raises(ValueError, match=r"dp=3 x tp=2 x pp=1 = 6 devices, but 8 are available"):
        zjax.make_mesh(dp=3, tp=2)


def test_cannot_infer():
    with pytest.raises(ValueError, match=r"cannot infer dp: 8 devices are not divisible by tp=3"):
        zjax.make_mesh(dp=-1, tp=3)


def test_two_inferred():
    with pytest.raises(ValueError, match="only one axis size may be -1"):
        zjax.make_mesh(dp=-1, tp=-1)


def test_bad_size_type():
    with pytest.raises(TypeError, match="tp=2.0 must be an int"):
        zjax.make_mesh(dp=-1, tp=2.0)
    with pytest.raises(ValueError, match="dp=0 must be a positive int or -1"):
        zjax.make_mesh(dp=0)
